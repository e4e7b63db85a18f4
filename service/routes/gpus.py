"""The GPU catalog: the models jobs can target."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, status
from kato.kernels import InvalidInput
from kato.service.schemas import NAME_PATTERN, GpuPublic, Name, error_responses, plain
from kato.service.strict import StrictJSONRoute
from kato.service.validation import gpu_catalog

router = APIRouter(prefix="/v1/gpus", tags=["gpus"], route_class=StrictJSONRoute)


@router.get("")
def get_gpus() -> list[GpuPublic]:
    """Every GPU model of the catalog, with the figures the tuner uses."""
    return [GpuPublic(**plain(gpu.to_dict())) for gpu in gpu_catalog().list_gpus()]


@router.get("/{name}", responses=error_responses(e404="no such GPU model"))
def get_gpu(
    name: Annotated[Name, Path(max_length=64, json_schema_extra={"pattern": NAME_PATTERN})],
) -> GpuPublic:
    """One GPU model, by canonical name or alias ("H200", "NVIDIA H200")."""
    try:
        gpu = gpu_catalog().get_gpu(name)
    except InvalidInput as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None
    return GpuPublic(**plain(gpu.to_dict()))
