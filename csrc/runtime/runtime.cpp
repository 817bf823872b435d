// Host runtime: loads JIT-compiled kernels, builds the kernel parameters (TMA
// descriptors over the symmetric buffer and the weights) once, and launches.
//
// Deliberately independent of PyTorch's C++ ABI: it takes device pointers, sizes and
// a CUDA stream handle as integers, and loads the CUDA driver with dlopen at run time,
// so one build serves every torch version and imports on machines with no GPU.
// Plain C++ only (no regex/locale/iostream state): the module shares its process with
// torch, NCCL, triton and vLLM's extensions.
#include <cuda.h>
#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "megamoe/params.h"

namespace py = pybind11;

namespace {

// ---------------------------------------------------------------- driver API
struct Driver {
  decltype(&::cuGetErrorString) GetErrorString;
  decltype(&::cuModuleLoad) ModuleLoad;
  decltype(&::cuModuleGetFunction) ModuleGetFunction;
  decltype(&::cuFuncSetAttribute) FuncSetAttribute;
  decltype(&::cuLaunchKernel) LaunchKernel;
  decltype(&::cuTensorMapEncodeTiled) TensorMapEncodeTiled;
  decltype(&::cuMemHostAlloc) MemHostAlloc;
  decltype(&::cuMemHostGetDevicePointer) MemHostGetDevicePointer;
  decltype(&::cuCtxGetCurrent) CtxGetCurrent;
  decltype(&::cuMemAlloc) MemAlloc;
  decltype(&::cuMemFree) MemFree;
  decltype(&::cuMemcpyHtoD) MemcpyHtoD;
  decltype(&::cuCtxPushCurrent) CtxPushCurrent;
  decltype(&::cuCtxPopCurrent) CtxPopCurrent;
};

Driver& driver() {
  static Driver d = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) throw std::runtime_error("megamoe: cannot load libcuda.so.1 (no NVIDIA driver on this machine)");
    auto sym = [lib](const char* name) {
      void* f = dlsym(lib, name);
      if (f == nullptr) throw std::runtime_error(std::string("megamoe: driver lacks ") + name);
      return f;
    };
    // Each entry point by its driver symbol (the _v2 ones are what cuda.h's macros name).
    auto bind = [&sym](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(sym(name));
    };
    Driver r;
    bind(r.GetErrorString, "cuGetErrorString");
    bind(r.ModuleLoad, "cuModuleLoad");
    bind(r.ModuleGetFunction, "cuModuleGetFunction");
    bind(r.FuncSetAttribute, "cuFuncSetAttribute");
    bind(r.LaunchKernel, "cuLaunchKernel");
    bind(r.TensorMapEncodeTiled, "cuTensorMapEncodeTiled");
    bind(r.MemHostAlloc, "cuMemHostAlloc");
    bind(r.MemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2");
    bind(r.CtxGetCurrent, "cuCtxGetCurrent");
    bind(r.MemAlloc, "cuMemAlloc_v2");
    bind(r.MemFree, "cuMemFree_v2");
    bind(r.MemcpyHtoD, "cuMemcpyHtoD_v2");
    bind(r.CtxPushCurrent, "cuCtxPushCurrent_v2");
    bind(r.CtxPopCurrent, "cuCtxPopCurrent_v2");
    return r;
  }();
  return d;
}

void check(CUresult res, const char* what) {
  if (res == CUDA_SUCCESS) return;
  const char* msg = nullptr;
  driver().GetErrorString(res, &msg);
  throw std::runtime_error(std::string("megamoe: ") + what + " failed: " + (msg ? msg : "unknown CUDA error"));
}

// ---------------------------------------------------------------- host words
// One params.h HostWords per process, host-mapped (portable: every context and device of
// the process writes the same one). The host side only ever reads it, with volatile loads.
struct HostWordsMapping {
  volatile megamoe::HostWords* host = nullptr;
  megamoe::HostWords* device = nullptr;
};

HostWordsMapping& host_words() {
  static HostWordsMapping w = [] {
    HostWordsMapping r;
    void* host = nullptr;
    check(driver().MemHostAlloc(&host, sizeof(megamoe::HostWords), CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE),
          "cuMemHostAlloc(host words)");
    std::memset(host, 0, sizeof(megamoe::HostWords));
    r.host = static_cast<volatile megamoe::HostWords*>(host);
    CUdeviceptr dev = 0;
    check(driver().MemHostGetDevicePointer(&dev, host, 0), "cuMemHostGetDevicePointer(host words)");
    r.device = reinterpret_cast<megamoe::HostWords*>(dev);
    return r;
  }();
  return w;
}

CUcontext current_context() {
  CUcontext ctx = nullptr;
  check(driver().CtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (ctx == nullptr) throw std::runtime_error("megamoe: no current CUDA context (initialize torch.cuda first)");
  return ctx;
}

// ---------------------------------------------------------------- kernels
struct Kernel {
  CUfunction function;
  CUfunction window_function;  // windowed variants' window kernel, launched after `function`; else null
  int smem_bytes;
};

// What make_params built: the per-call template, and the device memory it owns.
struct Params {
  megamoe::KernelParams kernel;
  CUcontext context;   // the one the descriptors were allocated in, to free them there
  CUdeviceptr tmaps;
};

std::mutex g_mutex;
std::map<std::string, CUmodule> g_modules;        // cubin path -> module (per current context)
std::vector<std::unique_ptr<Kernel>> g_kernels;   // handles given to Python; a handle is also the kernel's tag
std::vector<std::unique_ptr<Params>> g_params;    // handles given to Python; null once freed (never reused)

int load_kernel(const std::string& cubin_path, const std::string& name, int smem_bytes,
                const std::string& window_name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_kernels.size() > megamoe::kMaxKernelTag)
    throw std::runtime_error("megamoe: more kernel handles than a failure report can name");
  const CUcontext ctx = current_context();
  const std::string key = cubin_path + "@" + std::to_string(reinterpret_cast<uintptr_t>(ctx));
  auto it = g_modules.find(key);
  if (it == g_modules.end()) {
    CUmodule module = nullptr;
    check(driver().ModuleLoad(&module, cubin_path.c_str()), ("cuModuleLoad(" + cubin_path + ")").c_str());
    it = g_modules.emplace(key, module).first;
  }
  // One entry of the module, allowed the launch's dynamic shared memory.
  const auto entry = [&](const std::string& entry_name) {
    CUfunction function = nullptr;
    check(driver().ModuleGetFunction(&function, it->second, entry_name.c_str()),
          ("cuModuleGetFunction(" + entry_name + ")").c_str());
    check(driver().FuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes),
          ("cuFuncSetAttribute(" + entry_name + ", max dynamic shared memory)").c_str());
    return function;
  };
  auto k = std::make_unique<Kernel>();
  k->function = entry(name);
  k->window_function = window_name.empty() ? nullptr : entry(window_name);
  k->smem_bytes = smem_bytes;
  g_kernels.push_back(std::move(k));
  return static_cast<int>(g_kernels.size()) - 1;
}

// A 2-D tiled TMA descriptor over a row-major [rows, cols] matrix.
CUtensorMap make_tmap_2d(uint64_t ptr, CUtensorMapDataType dtype, int elem_bytes, uint64_t rows, uint64_t cols,
                         uint32_t box_cols, uint32_t box_rows, CUtensorMapSwizzle swizzle, const char* what) {
  CUtensorMap map;
  std::memset(&map, 0, sizeof(map));
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * elem_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  check(driver().TensorMapEncodeTiled(&map, dtype, 2, reinterpret_cast<void*>(ptr), dims, strides, box, elem_strides,
                                      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        what);
  return map;
}

// Builds everything a call needs that does not change per call. Returns a handle.
int make_params(const std::vector<uint64_t>& peer_ptrs, int rank, const std::map<std::string, int64_t>& offsets,
                int pool_capacity, int hidden, int inter, int num_local_experts, int block_m, uint64_t w13,
                uint64_t w13_scale, uint64_t w2, uint64_t w2_scale, double timeout_s, bool mxfp4_weights) {
  if (peer_ptrs.empty() || peer_ptrs.size() > megamoe::kMaxRanks)
    throw std::invalid_argument("megamoe: peer_ptrs must hold 1..8 buffer addresses");
  if (rank < 0 || rank >= static_cast<int>(peer_ptrs.size())) throw std::invalid_argument("megamoe: bad rank");
  auto entry = std::make_unique<Params>();
  std::memset(&entry->kernel, 0, sizeof(entry->kernel));
  megamoe::KernelParams* p = &entry->kernel;
  auto off = [&](const char* name) {
    auto it = offsets.find(name);
    if (it == offsets.end()) throw std::invalid_argument(std::string("megamoe: buffer offset missing: ") + name);
    return it->second;
  };
#define MEGAMOE_READ_OFFSET(region) p->off.region = off(#region);
  MEGAMOE_BUFFER_REGIONS(MEGAMOE_READ_OFFSET)
#undef MEGAMOE_READ_OFFSET
  for (size_t r = 0; r < peer_ptrs.size(); ++r) p->peer_base[r] = reinterpret_cast<uint8_t*>(peer_ptrs[r]);
  const uint64_t base = peer_ptrs[rank];
  p->l1_done = reinterpret_cast<int*>(base + p->off.l1_done);
  p->l2_tiles_claimed = reinterpret_cast<uint32_t*>(base + p->off.signals) + megamoe::kSigL2TilesClaimed;
  const uint64_t P = pool_capacity, H = hidden, I = inter, EL = num_local_experts;
  const auto FP8 = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  CUtensorMap maps[megamoe::kNumTmaps];
  const auto SW128 = CU_TENSOR_MAP_SWIZZLE_128B;
  maps[megamoe::kTmapPoolX] = make_tmap_2d(base + p->off.pool_x, FP8, 1, P, H, 128, block_m, SW128, "TMA pool_x");
  maps[megamoe::kTmapAct] = make_tmap_2d(base + p->off.act, FP8, 1, P, I, 128, block_m, SW128, "TMA act");
  if (mxfp4_weights) {  // packed E2M1 codes in the kernel's tiles: 256 rows x 64 bytes per k-block (params.h)
    const auto SW64 = CU_TENSOR_MAP_SWIZZLE_64B;
    const uint64_t N = megamoe::kBlockN, K = megamoe::kBlockK, w2_blocks = (H + N - 1) / N;
    maps[megamoe::kTmapW13] = make_tmap_2d(w13, FP8, 1, EL * (2 * I / N) * (H / K) * N, K / 2, K / 2, N, SW64,
                                           "TMA w13 (MXFP4)");
    maps[megamoe::kTmapW2] = make_tmap_2d(w2, FP8, 1, EL * w2_blocks * (I / K) * N, K / 2, K / 2, N, SW64,
                                          "TMA w2 (MXFP4)");
  } else {
    maps[megamoe::kTmapW13] = make_tmap_2d(w13, FP8, 1, EL * 2 * I, H, 128, 256, SW128, "TMA w13");
    maps[megamoe::kTmapW2] = make_tmap_2d(w2, FP8, 1, EL * H, I, 128, 256, SW128, "TMA w2");
  }
  // Device memory, written once here before any launch that reads it (never modified
  // on the device, so no tensormap proxy fence is needed). Lives until free_params.
  entry->context = current_context();
  check(driver().MemAlloc(&entry->tmaps, sizeof(maps)), "cuMemAlloc(TMA descriptors)");
  const CUresult copied = driver().MemcpyHtoD(entry->tmaps, maps, sizeof(maps));
  if (copied != CUDA_SUCCESS) driver().MemFree(entry->tmaps);
  check(copied, "cuMemcpyHtoD(TMA descriptors)");
  p->tmaps = reinterpret_cast<const CUtensorMap*>(entry->tmaps);
  p->w13_scale = reinterpret_cast<const float*>(w13_scale);
  p->w2_scale = reinterpret_cast<const float*>(w2_scale);
  p->rank = rank;
  p->pool_capacity = pool_capacity;
  p->host = host_words().device;
  // Saturating: a bound past 2^64 ns (584 years) means "never", not a wrapped 0 that traps every wait at once.
  if (!(timeout_s > 0)) throw std::invalid_argument("megamoe: timeout_s must be positive");
  const double timeout_ns = timeout_s * 1e9;
  p->timeout_ns = timeout_ns >= 1.8e19 ? UINT64_MAX : std::max<uint64_t>(1, static_cast<uint64_t>(timeout_ns));
  p->activation_clamp = __builtin_inff();
  std::lock_guard<std::mutex> lock(g_mutex);
  g_params.push_back(std::move(entry));
  return static_cast<int>(g_params.size()) - 1;
}

// Frees what make_params built for `params` (its descriptors' device memory). No launch
// that uses it may still be running or be replayed later from a CUDA graph.
void free_params(int params) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (params < 0 || params >= static_cast<int>(g_params.size()) || g_params[params] == nullptr)
    throw std::invalid_argument("megamoe: free_params: bad or already freed params handle");
  std::unique_ptr<Params> entry = std::move(g_params[params]);
  check(driver().CtxPushCurrent(entry->context), "cuCtxPushCurrent");
  const CUresult freed = driver().MemFree(entry->tmaps);
  CUcontext popped = nullptr;
  driver().CtxPopCurrent(&popped);
  check(freed, "cuMemFree(TMA descriptors)");
}

// One launch on `stream`. No allocation, no synchronization: safe to capture in a CUDA graph.
void launch(int kernel, int params, uint64_t y, int num_tokens, uint64_t recv_stats, double activation_clamp,
            int num_ctas, int num_threads, uint64_t stream, uint32_t call_tag, int stop_after_phase, uint64_t timeline,
            int window_launches) {
  if (call_tag >> megamoe::kCallTagBits) throw std::invalid_argument("megamoe: call_tag wider than abi.h kCallTagBits");
  if (kernel < 0 || kernel >= static_cast<int>(g_kernels.size())) throw std::invalid_argument("megamoe: bad kernel handle");
  if (params < 0 || params >= static_cast<int>(g_params.size()) || g_params[params] == nullptr)
    throw std::invalid_argument("megamoe: bad or freed params handle");
  const uint32_t err = host_words().host->error;
  if (err != megamoe::kErrNone)
    throw std::runtime_error("megamoe: an earlier kernel failed (error word " + std::to_string(err) +
                             "); the CUDA context is unusable");
  megamoe::KernelParams p = g_params[params]->kernel;
  p.y = reinterpret_cast<void*>(y);
  p.num_tokens = num_tokens;
  p.recv_stats = reinterpret_cast<int*>(recv_stats);
  p.activation_clamp = static_cast<float>(activation_clamp);
  p.stop_after_phase = stop_after_phase;
  p.window_launch = 0;
  p.timeline = reinterpret_cast<unsigned long long*>(timeline);
  p.kernel_tag = static_cast<uint32_t>(kernel);
  p.call_tag = call_tag;
  void* args[] = {&p};
  const Kernel& k = *g_kernels[kernel];
  check(driver().LaunchKernel(k.function, num_ctas, 1, 1, num_threads, 1, 1, k.smem_bytes,
                              reinterpret_cast<CUstream>(stream), args, nullptr),
        "cuLaunchKernel(megamoe)");
  // A windowed variant's window kernel, `window_launches` times (buffer.py window_kernel_launches):
  // each returns at once unless the call left it pool windows.
  if (k.window_function == nullptr) return;
  for (int launch = 0; launch < window_launches; ++launch) {
    p.window_launch = launch;
    check(driver().LaunchKernel(k.window_function, num_ctas, 1, 1, num_threads, 1, 1, k.smem_bytes,
                                reinterpret_cast<CUstream>(stream), args, nullptr),
          "cuLaunchKernel(megamoe window kernel)");
  }
}

// Plain reads of host memory, no CUDA call: any thread may poll them, also after a trap
// (megamoe_plugin/watchdog.py), and what a still-running kernel adds shows at a later read.
uint32_t read_error_word() { return host_words().host->error; }

uint64_t read_bad_expert_ids() { return host_words().host->bad_expert_ids; }

// Read after a non-zero error word (HostWords::detail says why that order gives a whole word).
uint64_t read_error_detail() { return host_words().host->detail; }

}  // namespace

PYBIND11_MODULE(_runtime, m) {
  m.doc() = "megamoe host runtime (torch-independent; loads libcuda at run time)";
  m.def("load_kernel", &load_kernel, py::arg("cubin_path"), py::arg("name"), py::arg("smem_bytes"),
        py::arg("window_name") = "");
  m.def("make_params", &make_params, py::arg("peer_ptrs"), py::arg("rank"), py::arg("offsets"),
        py::arg("pool_capacity"), py::arg("hidden"), py::arg("intermediate_size"), py::arg("num_local_experts"),
        py::arg("block_m"), py::arg("w13"), py::arg("w13_scale"), py::arg("w2"), py::arg("w2_scale"),
        py::arg("timeout_s"), py::arg("mxfp4_weights") = false);
  m.def("launch", &launch, py::arg("kernel"), py::arg("params"), py::arg("y"), py::arg("num_tokens"),
        py::arg("recv_stats"), py::arg("activation_clamp"), py::arg("num_ctas"), py::arg("num_threads"),
        py::arg("stream"), py::arg("call_tag"), py::arg("stop_after_phase") = 0, py::arg("timeline") = 0, py::arg("window_launches") = 0);
  m.def("free_params", &free_params, py::arg("params"));
  m.def("read_error_word", &read_error_word);
  m.def("read_bad_expert_ids", &read_bad_expert_ids);
  m.def("read_error_detail", &read_error_detail);
  m.attr("kParamsBytes") = sizeof(megamoe::KernelParams);
}
