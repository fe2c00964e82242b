// The part of ONNX Runtime's C API that cabinlm's kernels use, reached through the API's table.
//
// The kernels need no ONNX Runtime headers: OrtApi (onnxruntime_c_api.h) is a table of function
// pointers that ONNX Runtime only ever appends to, so an entry's index names it in every release
// from the version asked for on. What each entry is -- its index, its signature, the API version
// asked for, the enums' values -- comes from ort_api_entries.h, generated from a real
// onnxruntime_c_api.h by tools/gen_ort_api.py (tests/test_kernel_library.py checks it is current);
// nothing here types an index or a signature by hand. Every entry is called by a kernel, and every
// kernel runs in the tests (tests/test_kernels.py).

#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "ort_api_entries.h"

extern "C" {
struct OrtKernelInfo;
struct OrtShapeInferContext;
}

namespace cabinlm_ort {

// The version RegisterCustomOps asks for. Tests compile the library with a later one
// (-DCABINLM_REQUIRE_API_VERSION=N) to see the refusal an older onnxruntime gets.
#ifdef CABINLM_REQUIRE_API_VERSION
constexpr uint32_t kRequiredApiVersion = CABINLM_REQUIRE_API_VERSION;
#else
constexpr uint32_t kRequiredApiVersion = kApiVersion;
#endif

enum ErrorCode : int { kFail = ORT_FAIL, kInvalidArgument = ORT_INVALID_ARGUMENT };
enum ElementType : int {
  kFloat = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
  kUint8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8,
  kInt8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8,
  kInt32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32,
  kInt64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
  kAnyType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED,  // a variadic input of mixed types
};

struct ApiBase {  // OrtApiBase
  const void* const* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// The table of version kRequiredApiVersion, set once by RegisterCustomOps (register.cc) before any
// kernel can run: a session only runs the kernels of a library whose registration succeeded.
inline const void* const* g_api = nullptr;

// Entry E of `table`, typed as struct OrtApi declares it.
template <Entry E>
typename Signature<E>::type api(const void* const* table = g_api) {
  return reinterpret_cast<typename Signature<E>::type>(const_cast<void*>(table[E]));
}

inline OrtStatus* error(ErrorCode code, const std::string& msg) {
  return api<kCreateStatus>()(static_cast<OrtErrorCode>(code), msg.c_str());
}

// OrtStatus* -> early return
#define CABIN_TRY(expr)                    \
  do {                                     \
    if (OrtStatus* s_ = (expr)) return s_; \
  } while (0)

inline OrtStatus* dims_of(const OrtValue* v, std::vector<int64_t>* out) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  CABIN_TRY(api<kGetTensorTypeAndShape>()(v, &info));
  size_t n = 0;
  OrtStatus* s = api<kGetDimensionsCount>()(info, &n);
  if (!s) {
    out->assign(n, 0);
    s = api<kGetDimensions>()(info, out->data(), n);
  }
  api<kReleaseTensorTypeAndShapeInfo>()(info);
  return s;
}

inline OrtStatus* input_count(OrtKernelContext* ctx, size_t* n) { return api<kKernelContextGetInputCount>()(ctx, n); }

inline OrtStatus* input(OrtKernelContext* ctx, size_t i, const OrtValue** v) {
  return api<kKernelContextGetInput>()(ctx, i, v);
}

inline OrtStatus* output(OrtKernelContext* ctx, size_t i, const std::vector<int64_t>& dims, OrtValue** v) {
  return api<kKernelContextGetOutput>()(ctx, i, dims.data(), dims.size(), v);
}

template <typename T>
OrtStatus* data_of(const OrtValue* v, T** out) {
  void* p = nullptr;
  CABIN_TRY(api<kGetTensorMutableData>()(const_cast<OrtValue*>(v), &p));
  *out = static_cast<T*>(p);
  return nullptr;
}

// fn(data, unit) for unit in 0 .. units-1, in the session's intra-op pool.
inline OrtStatus* parallel_for(OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t units, void* data) {
  return api<kKernelContextParallelFor>()(ctx, fn, units, units, data);
}

inline std::string shape_str(const std::vector<int64_t>& d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + ")";
}

// OrtCustomOp, version 16 of its layout (onnxruntime_c_api.h).
struct CustomOp {
  uint32_t version;
  void* (*CreateKernel)(const CustomOp*, const void*, const OrtKernelInfo*);
  const char* (*GetName)(const CustomOp*);
  const char* (*GetExecutionProviderType)(const CustomOp*);
  int (*GetInputType)(const CustomOp*, size_t);
  size_t (*GetInputTypeCount)(const CustomOp*);
  int (*GetOutputType)(const CustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const CustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const CustomOp*, size_t);
  int (*GetOutputCharacteristic)(const CustomOp*, size_t);
  int (*GetInputMemoryType)(const CustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const CustomOp*);
  int (*GetVariadicInputHomogeneity)(const CustomOp*);
  int (*GetVariadicOutputMinArity)(const CustomOp*);
  int (*GetVariadicOutputHomogeneity)(const CustomOp*);
  OrtStatus* (*CreateKernelV2)(const CustomOp*, const void*, const OrtKernelInfo*, void**);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
  OrtStatus* (*InferOutputShapeFn)(const CustomOp*, OrtShapeInferContext*);
  int (*GetStartVersion)(const CustomOp*);
  int (*GetEndVersion)(const CustomOp*);
  size_t (*GetMayInplace)(int**, int**);
  void (*ReleaseMayInplace)(int*, int*);
  size_t (*GetAliasMap)(int**, int**);
  void (*ReleaseAliasMap)(int*, int*);
};

// How many of an operator's inputs are required: Op::kRequiredInputs where it declares one (the
// rest are optional, trailing), otherwise all of kInputTypes.
template <typename Op, typename = void>
struct RequiredInputs {
  static constexpr size_t value = sizeof Op::kInputTypes / sizeof Op::kInputTypes[0];
};
template <typename Op>
struct RequiredInputs<Op, std::void_t<decltype(Op::kRequiredInputs)>> {
  static constexpr size_t value = Op::kRequiredInputs;
};

// A stateless CPU operator: its first RequiredInputs inputs required (the rest optional), one float
// output, created and run through the V2 entries (which return a status). Op is a struct with static
// kName, kInputTypes and compute (and kRequiredInputs where trailing inputs are optional).
// Whether an operator's last input is variadic (Op::kVariadicTail; its arity at least 1, its types
// mixed: kInputTypes' last entry kAnyType).
template <typename Op, typename = void>
struct VariadicTail {
  static constexpr bool value = false;
};
template <typename Op>
struct VariadicTail<Op, std::void_t<decltype(Op::kVariadicTail)>> {
  static constexpr bool value = Op::kVariadicTail;
};

template <typename Op>
CustomOp make_op() {
  static int kernel_tag = 0;  // the kernels keep no state: every run reads its shapes from its inputs
  CustomOp op{};
  op.version = 16;
  op.GetName = [](const CustomOp*) { return Op::kName; };
  op.GetExecutionProviderType = [](const CustomOp*) { return "CPUExecutionProvider"; };
  op.GetInputType = [](const CustomOp*, size_t i) { return static_cast<int>(Op::kInputTypes[i]); };
  op.GetInputTypeCount = [](const CustomOp*) { return sizeof Op::kInputTypes / sizeof Op::kInputTypes[0]; };
  op.GetOutputType = [](const CustomOp*, size_t) { return static_cast<int>(kFloat); };
  op.GetOutputTypeCount = [](const CustomOp*) { return static_cast<size_t>(1); };
  op.KernelDestroy = [](void*) {};
  op.GetInputCharacteristic = [](const CustomOp*, size_t i) {  // 0 required, 1 optional, 2 variadic
    if (VariadicTail<Op>::value && i + 1 == sizeof Op::kInputTypes / sizeof Op::kInputTypes[0]) return 2;
    return i < RequiredInputs<Op>::value ? 0 : 1;
  };
  op.GetOutputCharacteristic = [](const CustomOp*, size_t) { return 0; };  // required
  op.GetInputMemoryType = [](const CustomOp*, size_t) { return 0; };       // the provider's default
  op.GetVariadicInputMinArity = [](const CustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const CustomOp*) { return VariadicTail<Op>::value ? 0 : 1; };
  op.GetVariadicOutputMinArity = [](const CustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const CustomOp*) { return 1; };
  op.CreateKernelV2 = [](const CustomOp*, const void*, const OrtKernelInfo*, void** kernel) -> OrtStatus* {
    *kernel = &kernel_tag;
    return nullptr;
  };
  op.KernelComputeV2 = [](void*, OrtKernelContext* ctx) { return Op::compute(ctx); };
  op.GetStartVersion = [](const CustomOp*) { return 1; };
  op.GetEndVersion = [](const CustomOp*) { return 2147483647; };
  return op;
}

// The operators the library registers (one per source file).
const CustomOp* int8_kv_attention_op();
const CustomOp* int8_kv_seats_attention_op();
const CustomOp* block_q4_matmul_op();
const CustomOp* block_q4_swiglu_matmul_op();
const CustomOp* block_q8_matmul_op();

}  // namespace cabinlm_ort
