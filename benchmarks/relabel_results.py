"""Carry committed results over to a new operator version when what was measured is unchanged.

Two kinds of files are covered: winners (``kato export`` files, ``*.t4.json``: data/h200) and
recorded spaces (Kernel Tuner caches written by ``kato export --format kt``, ``*.json[.gz]``:
data/spaces/*, tests/data/recorded).

A result's version is its operator's version when it was measured. The version changes with the
template, the space, or the spec's Python code (``OperatorSpec.version``), and a result of an old
version is never served or replayed as current. Many changes do not touch what was measured (a
new check elsewhere in the space, a tighter tolerance, new verification inputs, a change in how
the version is computed): this script takes the ``kernels`` package of the commit the files were
measured with (``--base``, by default HEAD: run it before committing the
change) and compares, for every config the file holds (a
winner file's best configs, a space's every entry), the rendered CUDA source, every launch
(kernel, grid, block, dynamic shared memory, arguments) and the validity check with the current
code. Only a file whose configs all render, launch and check the same is rewritten with the
current version (and renamed where its name holds the version); the rest are listed to measure
again. ``--compare preprocessed`` compares each config's translation unit after the C
preprocessor (host and sm_90 device passes, ``#include`` lines kept as text where their ``#if``
holds) instead of the rendered text: a template that gained code only under ``#if`` branches
the old configs do not take compiles to the same program for them. ``--compare ptx`` compares
the sm_90 PTX nvcc makes of each config (Kato's options): a template rewritten so that the old
configs compile to the same PTX leaves what was measured on the H200 alone.
``--add-param NAME=VALUE`` carries results over a space that gained a parameter: the current
code sees every config with ``NAME=VALUE`` added (the value that runs what the old code ran),
and the rewritten file holds it. A recorded space then lists that one value in its
``tune_params``: it is the whole valid space of the values it lists (the new parameter's other
values, e.g. a new algorithm, stay to be recorded).
Whether committed winners pass the current verification is the GPU suite's test
(tests/gpu/test_committed_winners_gpu.py). Run it from the repository's root; ``--dry-run`` only
reports.

    python3 benchmarks/relabel_results.py data/h200 data/spaces tests/data/recorded [--dry-run]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: Run under the old (or the current) ``kernels`` package. Reads ``{name: {operator, shape,
#: dtype, configs}}`` and prints, per name, the operator's version and per config a digest of
#: its rendered source, its launches and its check.
_DESCRIBE = r"""
import hashlib, json, os, re, subprocess, sys
from dataclasses import asdict
from kato import kernels
from kato.kernels import get_operator
# An editable install's finder would answer for a module the archived package lacks.
assert kernels.__file__.startswith(os.getcwd()), kernels.__file__
PREPROCESS = os.environ.get("KATO_RELABEL_PREPROCESS") == "1"
INCLUDE = re.compile(r"^\s*#\s*include\s*(.*)$", re.M)


_seen = {}


def digest(source):
    if os.environ.get("KATO_RELABEL_SOURCES") == "1":  # the caller compiles them
        return source
    if not PREPROCESS:
        return hashlib.sha256(source.encode()).hexdigest()
    if source not in _seen:  # a space's configs share few sources (launch-only parameters)
        _seen[source] = preprocessed(source)
    return _seen[source]


def preprocessed(source):
    # The translation unit as the compiler sees it, for the host and the sm_90 device pass:
    # #include lines become plain tokens (kept where their #if holds), blank lines dropped.
    body = INCLUDE.sub(lambda m: "KATO_INCLUDE " + m.group(1), source)
    units = []
    for flags in ([], ["-D__CUDACC__", "-D__CUDA_ARCH__=900"]):
        out = subprocess.run(["cpp", "-P", "-w", "-x", "c++", *flags], input=body,
                             capture_output=True, text=True, check=True).stdout
        units.append("\n".join(" ".join(line.split()) for line in out.splitlines()
                               if line.strip()))
    return hashlib.sha256("\0".join(units).encode()).hexdigest()


out = {}
for name, item in json.load(sys.stdin).items():
    spec = get_operator(item["operator"])
    shape, dtype = item["shape"], item["dtype"]
    described = []
    for config in item["configs"]:
        check = spec.check(config, shape, dtype)
        if check is None:
            source = digest(spec.render(config, shape, dtype))
            steps = [asdict(s) for s in spec.steps(config, shape, dtype)]
        else:
            source, steps = None, None
        described.append({"source": source, "steps": steps, "check": check})
    out[name] = {"version": spec.version, "configs": described}
json.dump(out, sys.stdout, default=str)
"""


class ResultFile:
    """One committed file: where its version is stored and which configs it holds."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.gzipped = path.suffix == ".gz"
        opener = gzip.open if self.gzipped else open
        with opener(path, "rt", encoding="utf-8") as f:
            self.data: dict[str, Any] = json.load(f)
        self.is_winners = path.name.endswith(".t4.json")

    @property
    def version(self) -> str:
        if self.is_winners:
            return self.data["metadata"]["kato"]["operator_version"]
        return self.data["kato_operator_version"]

    def item(self, added: dict[str, Any] | None = None) -> dict[str, Any]:
        """What :data:`_DESCRIBE` needs: the operator, shape, dtype and every config held
        (with the ``added`` parameters, for the current code's side)."""
        added = added or {}
        if self.is_winners:
            meta = self.data["metadata"]["kato"]
            configs = [{**b["config"], **added} for b in meta["best"]]
            return {**{k: meta[k] for k in ("operator", "shape", "dtype")}, "configs": configs}
        keys = self.data["tune_params_keys"]
        configs = [{**{k: e[k] for k in keys}, **added} for e in self.data["cache"].values()]
        return {
            "operator": self.data["kato_operator"],
            "shape": self.data["problem_size"],
            "dtype": self.data["dtype"],
            "configs": configs,
        }

    def relabel(self, version: str, dry_run: bool, added: dict[str, Any] | None = None) -> Path:
        """Write the file with ``version`` (renamed where its name holds the old one) and the
        ``added`` parameters in every config it holds."""
        old = self.version
        if self.is_winners:
            meta = self.data["metadata"]["kato"]
            meta["operator_version"] = version
            for name, value in (added or {}).items():
                if name not in meta.get("params", [name]):
                    meta["params"].append(name)
                for best in meta["best"]:
                    best["config"][name] = value
                for job in meta.get("jobs", []):
                    if isinstance(job.get("best_config"), dict):
                        job["best_config"][name] = value
                for result in self.data.get("results", []):  # every trial's config
                    if isinstance(result.get("configuration"), dict):
                        result["configuration"][name] = value
        else:
            self.data["kato_operator_version"] = version
            if isinstance(self.data.get("kato"), dict) and "operator_version" in self.data["kato"]:
                self.data["kato"]["operator_version"] = version
            if added:
                self._add_to_space(added)
        target = self.path.with_name(self.path.name.replace(old, version))
        if dry_run:
            return target
        # As ``kato export`` writes it: compact JSON; gzip without a timestamp.
        payload = json.dumps(self.data, separators=(",", ":"), allow_nan=False).encode()
        target.write_bytes(gzip.compress(payload, mtime=0) if self.gzipped else payload)
        if target != self.path:
            self.path.unlink()
        return target

    def _add_to_space(self, added: dict[str, Any]) -> None:
        """A recorded space's parameters gain ``added``, each with its one value: in the
        parameter lists, every entry (re-keyed: a key joins the values in parameter order) and
        the export metadata's configs."""
        data = self.data
        for name, value in added.items():
            if name not in data["tune_params_keys"]:
                data["tune_params_keys"].append(name)
            data["tune_params"][name] = [value]
        keys = data["tune_params_keys"]
        entries = [{**entry, **added} for entry in data["cache"].values()]
        data["cache"] = {",".join(str(e[k]) for k in keys): e for e in entries}
        meta = data.get("kato")
        if isinstance(meta, dict):
            params = meta.get("params")
            if isinstance(params, list):
                params += [name for name in added if name not in params]
            for job in meta.get("jobs", []):
                if isinstance(job.get("best_config"), dict):
                    job["best_config"].update(added)
            for best in meta.get("best", []):
                if isinstance(best.get("config"), dict):
                    best["config"].update(added)


def _describe(kernels_root: Path, items: dict[str, dict], mode: str = "source") -> dict[str, dict]:
    env = {"PYTHONPATH": str(kernels_root), "PATH": "/usr/bin:/bin"}
    if mode == "preprocessed":
        env["KATO_RELABEL_PREPROCESS"] = "1"
    elif mode == "ptx":
        env["KATO_RELABEL_SOURCES"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", _DESCRIBE],
        input=json.dumps(items),
        capture_output=True,
        text=True,
        cwd=kernels_root,
        env=env,
    )
    if result.returncode != 0:
        raise SystemExit(f"describing under {kernels_root} failed:\n{result.stderr}")
    described = json.loads(result.stdout)
    if mode == "ptx":
        _compile_sources(described)
    return described


def _ptx_digest(source: str) -> str:
    """sha256 of the sm_90 PTX nvcc makes of ``source`` with the options Kato compiles with."""
    from kato.tuner.nvcc import BASE_OPTIONS

    options = [o for o in BASE_OPTIONS if o not in ("-Xptxas", "-v")]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cu"
        path.write_text(source)
        ptx = subprocess.run(
            ["nvcc", "-ptx", "-arch=sm_90", *options, "-o", "-", str(path)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    return hashlib.sha256(ptx.encode()).hexdigest()


def _compile_sources(described: dict[str, dict]) -> None:
    """Replace every config's rendered source by the digest of its PTX (in place)."""
    from concurrent.futures import ThreadPoolExecutor

    configs = [c for item in described.values() for c in item["configs"] if c["source"]]
    # Each distinct source once: a recorded space's configs share few (parameters that are
    # launch geometry, not macros: 3536 batchnorm_stats configs are 84 sources).
    sources = sorted({c["source"] for c in configs})
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        digests = dict(zip(sources, pool.map(_ptx_digest, sources), strict=True))
    for config in configs:
        config["source"] = digests[config["source"]]


def _files(paths: list[Path]) -> list[Path]:
    found = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.name.endswith((".json", ".json.gz")))
        else:
            found.append(path)
    return found


def _parse_param(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise SystemExit(f"--add-param takes NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", type=Path, nargs="+", help="files or directories")
    parser.add_argument(
        "--base", default="HEAD", help="the commit whose code the files were measured with"
    )
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument(
        "--compare",
        choices=["source", "preprocessed", "ptx"],
        default="source",
        help="what must be the same for a config: its rendered text (default); its "
        "translation unit after the C preprocessor (cpp -P, host and sm_90 device passes); "
        "or the sm_90 PTX nvcc makes of it (what runs on the H200, whatever the template's "
        "text: one nvcc call per distinct source and side)",
    )
    parser.add_argument(
        "--add-param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a parameter the space gained, at the value that runs what the old code ran "
        "(JSON, else a string; repeatable)",
    )
    args = parser.parse_args(argv)
    added = dict(_parse_param(text) for text in args.add_param)
    files = {str(p): ResultFile(p) for p in _files(args.paths)}
    items = {name: f.item() for name, f in files.items()}
    now = _describe(ROOT, {name: f.item(added) for name, f in files.items()}, args.compare)
    with tempfile.TemporaryDirectory() as tmp:
        # kernels/ imports as kato.kernels: the archive needs the kato package and the db/
        # folder by which kato/__init__.py knows a source checkout (else the editable
        # install's finder answers with the working tree's modules).
        archive = subprocess.run(
            ["git", "archive", args.base, "kernels", "kato", "db"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        then = _describe(Path(tmp), items, args.compare)
    relabelled, current, retune = 0, 0, []
    for name, result in files.items():
        old, new = then[name], now[name]
        if result.version == new["version"]:
            current += 1
            continue
        if result.version != old["version"]:
            retune.append((name, f"measured at {result.version}, not {args.base}'s version"))
            continue
        if old["configs"] != new["configs"]:
            changed = sum(a != b for a, b in zip(old["configs"], new["configs"], strict=True))
            retune.append((name, f"{changed} configs render, launch or check differently"))
            continue
        target = result.relabel(new["version"], args.dry_run, added)
        print(f"{name} -> {target.name}")
        relabelled += 1
    for name, reason in retune:
        print(f"MEASURE AGAIN {name}: {reason}")
    print(f"{relabelled} relabelled, {current} current, {len(retune)} to measure again")
    return 1 if retune else 0


if __name__ == "__main__":
    raise SystemExit(main())
