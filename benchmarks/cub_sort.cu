// CUB's device radix sort (onesweep on sm_90) timed with CUDA events: the reference the radix
// path of sort_1d / sort_1d_pairs is measured against (issue 32), and CUB's segmented sorts for
// the row sort's radix path (sort, rows of cols keys: DeviceSegmentedRadixSort, kind "rows", and
// DeviceSegmentedSort, kind "rows_segsort"; keys only). Built and run by
// benchmarks/radix_sort.py:
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -o cub_sort benchmarks/cub_sort.cu
//   ./cub_sort <n> <float32|int32> <keys|pairs> [repeats]
//   ./cub_sort <n> <float32|int32> <rows|rows_segsort> <repeats> <cols>   (n = rows * cols)
//
// Prints one JSON line: {"n":..., "dtype":..., "kind":..., "ms": median per sort, "times": [...]}.
// Inputs: random 32-bit keys (floats: normal * 1000), values 0..n-1; each timed batch of 10
// sorts reads the same input (CUB's double buffer is reset by a copy outside the timing).

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>
#include <cub/device/device_segmented_sort.cuh>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CHECK(call)                                                                     \
  do {                                                                                  \
    cudaError_t err_ = (call);                                                          \
    if (err_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

enum Kind { kKeys, kPairs, kRows, kRowsSegsort };

template <class K>
static double run(long long n, Kind kind, long long cols, int repeats, std::vector<float>& times) {
  const bool pairs = kind == kPairs;
  std::vector<K> host(n);
  std::mt19937 gen(1);
  if constexpr (std::is_same_v<K, float>) {
    std::normal_distribution<float> dist(0.f, 1000.f);
    for (auto& k : host) k = dist(gen);
  } else {
    std::uniform_int_distribution<int> dist(INT32_MIN, INT32_MAX);
    for (auto& k : host) k = dist(gen);
  }
  std::vector<int> idx(n);
  for (long long i = 0; i < n; ++i) idx[i] = static_cast<int>(i);
  K *keys_in, *keys_out;
  int *vals_in, *vals_out;
  CHECK(cudaMalloc(&keys_in, n * sizeof(K)));
  CHECK(cudaMalloc(&keys_out, n * sizeof(K)));
  CHECK(cudaMalloc(&vals_in, n * sizeof(int)));
  CHECK(cudaMalloc(&vals_out, n * sizeof(int)));
  CHECK(cudaMemcpy(keys_in, host.data(), n * sizeof(K), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(vals_in, idx.data(), n * sizeof(int), cudaMemcpyHostToDevice));
  // Rows: segment r is keys r * cols .. (r + 1) * cols - 1 (begin offsets, end = begin + 1).
  const int rows = static_cast<int>(n / cols);
  std::vector<int> offsets(rows + 1);
  for (int r = 0; r <= rows; ++r) offsets[r] = static_cast<int>(r * cols);
  int* d_offsets;
  CHECK(cudaMalloc(&d_offsets, (rows + 1) * sizeof(int)));
  CHECK(cudaMemcpy(d_offsets, offsets.data(), (rows + 1) * sizeof(int), cudaMemcpyHostToDevice));
  size_t temp_bytes = 0;
  void* temp = nullptr;
  const int num = static_cast<int>(n);
  auto sort = [&]() {
    if (kind == kRows) {
      CHECK(cub::DeviceSegmentedRadixSort::SortKeys(temp, temp_bytes, keys_in, keys_out, num, rows,
                                                    d_offsets, d_offsets + 1));
    } else if (kind == kRowsSegsort) {
      CHECK(cub::DeviceSegmentedSort::SortKeys(temp, temp_bytes, keys_in, keys_out, num, rows,
                                               d_offsets, d_offsets + 1));
    } else if (pairs) {
      CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, vals_in,
                                            vals_out, num));
    } else {
      CHECK(cub::DeviceRadixSort::SortKeys(temp, temp_bytes, keys_in, keys_out, num));
    }
  };
  sort();  // sizes the temporary storage
  CHECK(cudaMalloc(&temp, temp_bytes));
  for (int i = 0; i < 3; ++i) sort();
  CHECK(cudaDeviceSynchronize());
  // Check the output once: sorted, and (pairs) the values are a permutation following the keys.
  std::vector<K> out(n);
  CHECK(cudaMemcpy(out.data(), keys_out, n * sizeof(K), cudaMemcpyDeviceToHost));
  for (long long first = 0; first < n; first += cols) {
    if (!std::is_sorted(out.begin() + first, out.begin() + first + cols)) {
      std::fprintf(stderr, "CUB output not sorted\n");
      std::exit(2);
    }
  }
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  const int batch = 10;
  for (int r = 0; r < repeats; ++r) {
    CHECK(cudaEventRecord(start));
    for (int b = 0; b < batch; ++b) sort();
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms / batch);
  }
  std::vector<float> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  CHECK(cudaFree(temp));
  CHECK(cudaFree(keys_in));
  CHECK(cudaFree(keys_out));
  CHECK(cudaFree(vals_in));
  CHECK(cudaFree(vals_out));
  CHECK(cudaFree(d_offsets));
  return sorted[sorted.size() / 2];
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr,
                 "usage: %s <n> <float32|int32> <keys|pairs|rows|rows_segsort> [repeats] "
                 "[cols]\n",
                 argv[0]);
    return 1;
  }
  const long long n = std::atoll(argv[1]);
  const std::string dtype = argv[2], kind = argv[3];
  const int repeats = argc > 4 ? std::atoi(argv[4]) : 20;
  const bool rows = kind == "rows" || kind == "rows_segsort";
  const long long cols = rows && argc > 5 ? std::atoll(argv[5]) : n;
  if (n < 1 || n > INT32_MAX || (dtype != "float32" && dtype != "int32") ||
      (kind != "keys" && kind != "pairs" && !rows) || repeats < 1 || cols < 1 || n % cols != 0) {
    std::fprintf(stderr, "bad arguments\n");
    return 1;
  }
  std::vector<float> times;
  const Kind k = kind == "pairs"          ? kPairs
                 : kind == "rows"         ? kRows
                 : kind == "rows_segsort" ? kRowsSegsort
                                          : kKeys;
  const double ms = dtype == "float32" ? run<float>(n, k, cols, repeats, times)
                                       : run<int>(n, k, cols, repeats, times);
  std::printf("{\"n\": %lld, \"dtype\": \"%s\", \"kind\": \"%s\", \"ms\": %.6f, \"times\": [", n,
              dtype.c_str(), kind.c_str(), ms);
  for (size_t i = 0; i < times.size(); ++i) std::printf("%s%.6f", i ? ", " : "", times[i]);
  std::printf("]}\n");
  return 0;
}
