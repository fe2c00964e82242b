// The library's entry point: ONNX Runtime calls RegisterCustomOps when a session registers the
// library (SessionOptions.register_custom_ops_library), and every operator joins domain ai.cabinlm.

#include "ort_api.h"

using namespace cabinlm_ort;

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                              const ApiBase* base) {
  g_api = base->GetApi(kApiVersion);
  if (!g_api) return nullptr;  // an ONNX Runtime older than 1.18: nothing registered, the graph will not load
  OrtCustomOpDomain* domain = nullptr;
  CABIN_TRY(entry<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)("ai.cabinlm", &domain));
  for (const CustomOp* op : {int8_kv_attention_op(), block_q4_matmul_op(), block_q4_swiglu_matmul_op()})
    CABIN_TRY(entry<OrtStatus* (*)(OrtCustomOpDomain*, const CustomOp*)>(kCustomOpDomainAdd)(domain, op));
  // The domain lives as long as the process: ONNX Runtime reads it for every session that uses it.
  return entry<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(options, domain);
}
