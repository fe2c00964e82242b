// The library's entry point: ONNX Runtime calls RegisterCustomOps when a session registers the
// library (SessionOptions.register_custom_ops_library), and every operator joins domain ai.cabinlm.
//
// An onnxruntime older than the C API version the library was compiled for has no table of that
// version: GetApi returns nullptr (and prints a line of its own). Returning nullptr here would mean
// success with nothing registered, and the graph would fail later on an unknown operator. So the
// refusal is an error status, made through the version-1 table: CreateStatus is entry 0 of every
// version's table, and every onnxruntime serves version 1.

#include <string>

#include "ort_api.h"

using namespace cabinlm_ort;

namespace cabinlm_ort {
// int8_kv_attention.cc's operators over a float32 cache (declared here beside ort_api.h's list)
const CustomOp* float_kv_attention_op();
const CustomOp* float_kv_seats_attention_op();
// lora_terms.cc's switchable adapters' terms
const CustomOp* lora_terms_op();
const CustomOp* lora_swiglu_terms_op();
}  // namespace cabinlm_ort

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                              const ApiBase* base) {
  g_api = base->GetApi(kRequiredApiVersion);
  if (!g_api) {
    const void* const* v1 = base->GetApi(1);
    if (!v1) return nullptr;  // no onnxruntime lacks version 1; nothing else could carry the refusal
    std::string msg = "cabinlm's kernels need onnxruntime's C API version " + std::to_string(kRequiredApiVersion) +
                      " (onnxruntime >= 1." + std::to_string(kRequiredApiVersion) + "); this onnxruntime is " +
                      base->GetVersionString() + "; install onnxruntime>=1." + std::to_string(kRequiredApiVersion);
    return api<kCreateStatus>(v1)(ORT_FAIL, msg.c_str());
  }
  OrtCustomOpDomain* domain = nullptr;
  CABIN_TRY(api<kCreateCustomOpDomain>()("ai.cabinlm", &domain));
  for (const CustomOp* op : {int8_kv_attention_op(), int8_kv_seats_attention_op(), float_kv_attention_op(),
                             float_kv_seats_attention_op(), block_q4_matmul_op(), block_q4_swiglu_matmul_op(),
                             block_q8_matmul_op(), lora_terms_op(), lora_swiglu_terms_op()})
    CABIN_TRY(api<kCustomOpDomainAdd>()(domain, reinterpret_cast<const OrtCustomOp*>(op)));
  // The domain lives as long as the process: ONNX Runtime reads it for every session that uses it.
  return api<kAddCustomOpDomain>()(options, domain);
}
