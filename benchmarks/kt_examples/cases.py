"""The benchmark's cases: ``CASES[name](scale)`` returns the keyword arguments of one
``tune_kernel`` call (the same for ``kernel_tuner.tune_kernel`` and ``kato.tune_kernel``).
``scale`` < 1 shrinks the problem (a quick check); 1 is the measured size."""

from __future__ import annotations

from typing import Any

import numpy as np

VECTOR_ADD = r"""
__global__ void vector_add(float *c, const float *a, const float *b, int n) {
    int i = blockIdx.x * block_size_x * tile_size_x + threadIdx.x;
#pragma unroll
    for (int t = 0; t < tile_size_x; t++, i += block_size_x) {
        if (i < n) c[i] = a[i] + b[i];
    }
}
"""

# C = A @ B on WIDTH x WIDTH floats: a block computes a (block_size_y * tile_size_y) x
# (block_size_x * tile_size_x) tile of C through shared-memory tiles of A and B.
MATMUL = r"""
#define BM (block_size_y * tile_size_y)
#define BN (block_size_x * tile_size_x)
#define BK block_size_x
__global__ void matmul_kernel(float *C, const float *A, const float *B) {
    __shared__ float sA[BM][BK];
    __shared__ float sB[BK][BN];
    int tx = threadIdx.x, ty = threadIdx.y;
    int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    float acc[tile_size_y][tile_size_x] = {};
    for (int k0 = 0; k0 < WIDTH; k0 += BK) {
#pragma unroll
        for (int i = 0; i < tile_size_y; i++)
            for (int k = tx; k < BK; k += block_size_x)
                sA[ty + i * block_size_y][k] = A[(row0 + ty + i * block_size_y) * WIDTH + k0 + k];
        for (int k = ty; k < BK; k += block_size_y)
#pragma unroll
            for (int j = 0; j < tile_size_x; j++)
                sB[k][tx + j * block_size_x] = B[(k0 + k) * WIDTH + col0 + tx + j * block_size_x];
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; k++) {
#pragma unroll
            for (int i = 0; i < tile_size_y; i++)
#pragma unroll
                for (int j = 0; j < tile_size_x; j++)
                    acc[i][j] += sA[ty + i * block_size_y][k] * sB[k][tx + j * block_size_x];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < tile_size_y; i++)
#pragma unroll
        for (int j = 0; j < tile_size_x; j++)
            C[(row0 + ty + i * block_size_y) * WIDTH + col0 + tx + j * block_size_x] = acc[i][j];
}
"""

# out[y][x] = sum over the filter of in[y + i][x + j] * filter[i][j] ("valid" correlation);
# each thread computes tile_size_y x tile_size_x outputs; read_only=1 loads through __ldg.
CONVOLUTION = r"""
#if read_only
#define LOAD(p) __ldg(p)
#else
#define LOAD(p) (*(p))
#endif
__global__ void convolution_kernel(float *out, const float *in, const float *filter) {
    int x0 = blockIdx.x * block_size_x * tile_size_x + threadIdx.x;
    int y0 = blockIdx.y * block_size_y * tile_size_y + threadIdx.y;
    float sum[tile_size_y][tile_size_x] = {};
    for (int i = 0; i < FH; i++) {
        for (int j = 0; j < FW; j++) {
            float f = LOAD(filter + i * FW + j);
#pragma unroll
            for (int ty = 0; ty < tile_size_y; ty++)
#pragma unroll
                for (int tx = 0; tx < tile_size_x; tx++) {
                    int x = x0 + tx * block_size_x, y = y0 + ty * block_size_y;
                    if (x < IW && y < IH)
                        sum[ty][tx] += LOAD(in + (y + i) * (IW + FW - 1) + x + j) * f;
                }
        }
    }
#pragma unroll
    for (int ty = 0; ty < tile_size_y; ty++)
#pragma unroll
        for (int tx = 0; tx < tile_size_x; tx++) {
            int x = x0 + tx * block_size_x, y = y0 + ty * block_size_y;
            if (x < IW && y < IH) out[y * IW + x] = sum[ty][tx];
        }
}
"""

# The sum of n floats in one launch: each block sums a grid-stride share (vectors of vec
# floats), writes its partial, and the last block to finish adds the partials in a fixed order
# and resets the ticket counter for the next call.
REDUCTION = r"""
__global__ void sum_floats(float *out, const float *in, float *partials, unsigned int *ticket,
                           int n) {
    __shared__ float warp_sums[32];
    __shared__ bool last;
    float s = 0.0f;
    int stride = gridDim.x * block_size_x * vec;
    for (int i = (blockIdx.x * block_size_x + threadIdx.x) * vec; i < n; i += stride) {
#if vec == 4
        float4 v = *reinterpret_cast<const float4 *>(in + i);
        s += (v.x + v.y) + (v.z + v.w);
#elif vec == 2
        float2 v = *reinterpret_cast<const float2 *>(in + i);
        s += v.x + v.y;
#else
        s += in[i];
#endif
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffff, s, o);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        s = threadIdx.x < block_size_x / 32 ? warp_sums[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffff, s, o);
        if (threadIdx.x == 0) {
            partials[blockIdx.x] = s;
            __threadfence();
            last = atomicAdd(ticket, 1u) == gridDim.x - 1;
        }
    }
    __syncthreads();
    if (last) {
        float t = 0.0f;
        for (int b = threadIdx.x; b < gridDim.x; b += block_size_x) t += partials[b];
        for (int o = 16; o > 0; o >>= 1) t += __shfl_down_sync(0xffffffff, t, o);
        if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = t;
        __syncthreads();
        if (threadIdx.x == 0) {
            float total = 0.0f;
            for (int w = 0; w < block_size_x / 32; w++) total += warp_sums[w];
            out[0] = total;
            *ticket = 0;
        }
    }
}
"""


def vector_add(scale: float = 1.0) -> dict[str, Any]:
    n = max(1 << 12, int((1 << 26) * scale))
    rng = np.random.default_rng(1)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    return {
        "kernel_name": "vector_add",
        "kernel_source": VECTOR_ADD,
        "problem_size": n,
        "arguments": [np.zeros_like(a), a, b, np.int32(n)],
        "tune_params": {
            "block_size_x": [32 * i for i in range(1, 33)],
            "tile_size_x": [1, 2, 4, 8],
        },
        "grid_div_x": ["block_size_x", "tile_size_x"],
        "answer": [a + b, None, None, None],
    }


def matmul(scale: float = 1.0) -> dict[str, Any]:
    width = 4096 if scale >= 1 else 512
    rng = np.random.default_rng(2)
    a = rng.standard_normal((width, width)).astype(np.float32)
    b = rng.standard_normal((width, width)).astype(np.float32)
    expected = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
    smem = (
        "4 * (block_size_y * tile_size_y * block_size_x"
        " + block_size_x * block_size_x * tile_size_x)"
    )
    return {
        "kernel_name": "matmul_kernel",
        # Constants in the source, not Kernel Tuner's ``defines`` (which replace its macros).
        "kernel_source": f"#define WIDTH {width}\n" + MATMUL,
        "problem_size": (width, width),
        "arguments": [np.zeros_like(a), a, b],
        "tune_params": {
            "block_size_x": [8, 16, 32, 64],
            "block_size_y": [2, 4, 8, 16, 32],
            "tile_size_x": [1, 2, 4, 8],
            "tile_size_y": [1, 2, 4, 8],
        },
        "grid_div_x": ["block_size_x", "tile_size_x"],
        "grid_div_y": ["block_size_y", "tile_size_y"],
        "restrictions": [
            f"{smem} <= 48 * 1024",
            "block_size_x * block_size_y >= 64",
            "block_size_x * block_size_y <= 1024",
            f"{width} % (block_size_x * tile_size_x) == 0",
            f"{width} % (block_size_y * tile_size_y) == 0",
        ],
        "answer": [expected, None, None],
        "atol": 5e-2,
    }


def convolution(scale: float = 1.0) -> dict[str, Any]:
    from scipy.signal import fftconvolve

    w = h = 4096 if scale >= 1 else 512
    fh = fw = 17
    rng = np.random.default_rng(3)
    image = rng.standard_normal((h + fh - 1, w + fw - 1)).astype(np.float32)
    filt = rng.standard_normal((fh, fw)).astype(np.float32)
    expected = fftconvolve(image.astype(np.float64), filt[::-1, ::-1].astype(np.float64), "valid")
    return {
        "kernel_name": "convolution_kernel",
        "kernel_source": f"#define IW {w}\n#define IH {h}\n#define FW {fw}\n#define FH {fh}\n"
        + CONVOLUTION,
        "problem_size": (w, h),
        "arguments": [np.zeros((h, w), np.float32), image, filt],
        "tune_params": {
            "block_size_x": [16, 32, 48, 64, 128],
            "block_size_y": [1, 2, 4, 8, 16],
            "tile_size_x": [1, 2, 4],
            "tile_size_y": [1, 2, 4, 8],
            "read_only": [0, 1],
        },
        "grid_div_x": ["block_size_x", "tile_size_x"],
        "grid_div_y": ["block_size_y", "tile_size_y"],
        "restrictions": [
            "block_size_x * block_size_y >= 64",
            "block_size_x * block_size_y <= 1024",
        ],
        "answer": [expected.astype(np.float32), None, None],
        "atol": 1e-3,
    }


def reduction(scale: float = 1.0) -> dict[str, Any]:
    n = max(1 << 16, int((1 << 26) * scale))
    rng = np.random.default_rng(4)
    x = rng.standard_normal(n).astype(np.float32)
    total = np.array([x.astype(np.float64).sum()], np.float32)
    return {
        "kernel_name": "sum_floats",
        "kernel_source": REDUCTION,
        "problem_size": n,
        "arguments": [
            np.zeros(1, np.float32),
            x,
            np.zeros(8192, np.float32),
            np.zeros(1, np.uint32),
            np.int32(n),
        ],  # fmt: skip
        "tune_params": {
            "block_size_x": [64, 128, 256, 512, 1024],
            "num_blocks": [132 * k for k in (1, 2, 4, 8, 16, 32)] + [256, 512, 1024, 2048, 4096],
            "vec": [1, 2, 4],
        },
        # The grid is num_blocks where ceil(n / ceil(n / num_blocks)) equals it.
        "grid_div_x": [f"({n} + num_blocks - 1) // num_blocks"],
        "restrictions": [
            f"({n} + ({n} + num_blocks - 1) // num_blocks - 1)"
            f" // (({n} + num_blocks - 1) // num_blocks) == num_blocks",
            f"{n} % vec == 0",
        ],
        "answer": [total, None, None, None, None],
        "atol": 0.5,
    }


CASES = {
    "vector_add": vector_add,
    "matmul": matmul,
    "convolution": convolution,
    "reduction": reduction,
}
