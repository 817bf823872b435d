// megamoe_plugin._abi: the host/device ABI (csrc/megamoe/abi.h) as Python values, read by
// megamoe_plugin/abi.py. It needs the host compiler and pybind11 only (no CUDA header), so it builds
// wherever the package does, also where the runtime extension cannot.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "megamoe/abi.h"

namespace py = pybind11;

namespace {

// abi.h's constants and enumerators, by their C++ names (megamoe_plugin.abi binds them as they are).
std::map<std::string, int64_t> constants() {
  using namespace megamoe;
  std::map<std::string, int64_t> c;
#define MEGAMOE_EXPORT(name) c[#name] = static_cast<int64_t>(name);
  MEGAMOE_EXPORT(kMaxRanks)
  MEGAMOE_EXPORT(kBlockN)
  MEGAMOE_EXPORT(kBlockK)
  MEGAMOE_EXPORT(kNumThreads)
  MEGAMOE_EXPORT(kNumMathThreads)
  MEGAMOE_EXPORT(kErrNone)
  MEGAMOE_EXPORT(kErrGridBarrierTimeout)
  MEGAMOE_EXPORT(kErrPipelineFullTimeout)
  MEGAMOE_EXPORT(kErrPipelineEmptyTimeout)
  MEGAMOE_EXPORT(kErrL1RowsTimeout)
  MEGAMOE_EXPORT(kErrPulledRowsTimeout)
  MEGAMOE_EXPORT(kErrCombineRowsTimeout)
  MEGAMOE_EXPORT(kErrCallMismatch)
  MEGAMOE_EXPORT(kErrRankNotArrived)
  MEGAMOE_EXPORT(kErrorRankShift)
  MEGAMOE_EXPORT(kErrorTagShift)
  MEGAMOE_EXPORT(kMaxKernelTag)
  MEGAMOE_EXPORT(kDetailPeerShift)
  MEGAMOE_EXPORT(kDetailOwnTagShift)
  MEGAMOE_EXPORT(kDetailPeerTagShift)
  MEGAMOE_EXPORT(kCallTagLayerMask)
  MEGAMOE_EXPORT(kCallTagExact)
  MEGAMOE_EXPORT(kCallTagFastMath)
  MEGAMOE_EXPORT(kCallTagRefused)
  MEGAMOE_EXPORT(kCallTagBits)
  MEGAMOE_EXPORT(kNumSignalWords)
  MEGAMOE_EXPORT(kSigGridArrivals)
  MEGAMOE_EXPORT(kSigGridGeneration)
  MEGAMOE_EXPORT(kSigRankBarrierDone)
  MEGAMOE_EXPORT(kSigL2TilesClaimed)
  MEGAMOE_EXPORT(kSigWindowsPending)
  MEGAMOE_EXPORT(kSigMblocksToClear)
  MEGAMOE_EXPORT(kSigTokensToClear)
  MEGAMOE_EXPORT(kSigRankArrivals)
  MEGAMOE_EXPORT(kTimelineMaxTiles)
  MEGAMOE_EXPORT(kTimelineSlots)
  MEGAMOE_EXPORT(kTimelinePullSlot)
  MEGAMOE_EXPORT(kTimelineRecords)
  MEGAMOE_EXPORT(kTimelineWords)
  MEGAMOE_EXPORT(kSmemLimit)
  MEGAMOE_EXPORT(kSmemAlignSlack)
  MEGAMOE_EXPORT(kFp4GroupSize)
  MEGAMOE_EXPORT(kFp4ScaleBytesPerRow)
  MEGAMOE_EXPORT(kFp4BlockCodeBytes)
#undef MEGAMOE_EXPORT
  return c;
}

// BufferOffsets' fields, in order.
std::vector<std::string> buffer_regions() {
  std::vector<std::string> names;
#define MEGAMOE_REGION_NAME(region) names.push_back(#region);
  MEGAMOE_BUFFER_REGIONS(MEGAMOE_REGION_NAME)
#undef MEGAMOE_REGION_NAME
  return names;
}

std::map<std::string, int> smem_plan(int block_m, int num_stages, int num_local_experts, bool exact, bool fp4) {
  const megamoe::SmemPlan s = megamoe::smem_plan(block_m, num_stages, num_local_experts, exact, fp4);
  return {{"amax_exchange", s.amax_exchange}, {"tables", s.tables}, {"quad_lines", s.quad_lines},
          {"l1_token_scales", s.l1_token_scales}, {"l1_tokens", s.l1_tokens},
          {"fp4_tile", s.fp4_tile}, {"stages", s.stages},
          {"stage", s.stage}, {"bytes", s.bytes}, {"min_stages", s.min_stages}};
}

}  // namespace

PYBIND11_MODULE(_abi, m) {
  m.doc() = "megamoe host/device ABI (csrc/megamoe/abi.h)";
  m.def("constants", &constants);
  m.def("buffer_regions", &buffer_regions);
  m.def("smem_plan", &smem_plan, py::arg("block_m"), py::arg("num_stages"), py::arg("num_local_experts"),
        py::arg("exact"), py::arg("fp4") = false);
}
