// A small Metal Shading Language compatibility layer for clang-19 (C++20).
//
// It stands in for what MLX prepends to a custom kernel (`metal::utils()`:
// <metal_stdlib>, `using namespace metal`, bfloat16_t, Limits<T>, elem_to_loc),
// so the exact source MLX generates compiles as C++ and runs on a CPU:
//
// - address spaces are clang `address_space` attributes (device=1, constant=2,
//   threadgroup=3), so passing a pointer of the wrong space fails to compile as in
//   Metal; `thread` is the default space;
// - vectors are `ext_vector_type` (swizzles work); half is _Float16, bfloat __bf16;
// - metal::, metal::fast:: and metal::precise:: math; simd_* functions and barriers
//   synchronise cooperative fibers through the runtime (msl_runtime.cpp).
//
// No libc header is included on purpose: <math.h> would put `double exp(double)`
// and `int abs(int)` in the global namespace and make unqualified Metal calls
// ambiguous under `using namespace metal`.
#pragma once

#include "msl_abi.h"

#ifdef MSL_FLAT_ADDRESS_SPACES
// Counting and ubsan builds need plain pointers: clang's address sanitizer (used for
// the load/store callbacks, see msl_runtime.cpp) and its alignment check skip
// accesses through other address spaces. The address-space checks run in the
// default and cxx14 builds.
#define device
#define constant
#define threadgroup
#else
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#endif
#define thread
#define METAL_FUNC inline __attribute__((always_inline))
#define MLX_MTL_PRAGMA_UNROLL _Pragma("clang loop unroll(full)")
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define MAXFLOAT __FLT_MAX__
#define FLT_MAX __FLT_MAX__
#define FLT_MIN __FLT_MIN__
#define FLT_EPSILON __FLT_EPSILON__
#define M_PI_F 3.14159265358979323846f

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef _Float16 half;
typedef __bf16 bfloat;

#define MSL_VEC(T, name)                                  \
  typedef T name##2 __attribute__((ext_vector_type(2))); \
  typedef T name##3 __attribute__((ext_vector_type(3))); \
  typedef T name##4 __attribute__((ext_vector_type(4)));
MSL_VEC(float, float)
MSL_VEC(half, half)
MSL_VEC(bfloat, bfloat)
MSL_VEC(int, int)
MSL_VEC(uint, uint)
MSL_VEC(short, short)
MSL_VEC(ushort, ushort)
MSL_VEC(char, char)
MSL_VEC(uchar, uchar)
MSL_VEC(long, long)
MSL_VEC(unsigned long, ulong)
#undef MSL_VEC
typedef unsigned long ulong;

namespace metal {

template <typename T, int N>
using vec = T __attribute__((ext_vector_type(N)));

enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(unsigned(a) | unsigned(b));
}

enum memory_order { memory_order_relaxed, memory_order_seq_cst };

template <typename T, typename U>
METAL_FUNC T as_type(U x) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs types of the same size");
  return __builtin_bit_cast(T, x);
}

// ---- numeric limits (std::numeric_limits lacks _Float16/__bf16 in libstdc++ 12)
template <typename T>
struct numeric_limits;
template <>
struct numeric_limits<float> {
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
  static constexpr float max() { return __FLT_MAX__; }
  static constexpr float min() { return __FLT_MIN__; }
  static constexpr float lowest() { return -__FLT_MAX__; }
  static constexpr float epsilon() { return __FLT_EPSILON__; }
};
template <>
struct numeric_limits<half> {
  static constexpr half infinity() { return __builtin_bit_cast(half, (unsigned short)0x7c00); }
  static constexpr half quiet_NaN() { return __builtin_bit_cast(half, (unsigned short)0x7e00); }
  static constexpr half max() { return __builtin_bit_cast(half, (unsigned short)0x7bff); }
  static constexpr half min() { return __builtin_bit_cast(half, (unsigned short)0x0400); }
  static constexpr half lowest() { return __builtin_bit_cast(half, (unsigned short)0xfbff); }
  static constexpr half epsilon() { return __builtin_bit_cast(half, (unsigned short)0x1400); }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bfloat infinity() { return __builtin_bit_cast(bfloat, (unsigned short)0x7f80); }
  static constexpr bfloat quiet_NaN() { return __builtin_bit_cast(bfloat, (unsigned short)0x7fc0); }
  static constexpr bfloat max() { return __builtin_bit_cast(bfloat, (unsigned short)0x7f7f); }
  static constexpr bfloat min() { return __builtin_bit_cast(bfloat, (unsigned short)0x0080); }
  static constexpr bfloat lowest() { return __builtin_bit_cast(bfloat, (unsigned short)0xff7f); }
  static constexpr bfloat epsilon() { return __builtin_bit_cast(bfloat, (unsigned short)0x3c00); }
};
#define MSL_INT_LIMITS(T, lo, hi)                    \
  template <>                                        \
  struct numeric_limits<T> {                         \
    static constexpr T max() { return hi; }          \
    static constexpr T min() { return lo; }          \
    static constexpr T lowest() { return lo; }       \
  };
MSL_INT_LIMITS(bool, false, true)
MSL_INT_LIMITS(int8_t, INT8_MIN, INT8_MAX)
MSL_INT_LIMITS(uint8_t, 0, UINT8_MAX)
MSL_INT_LIMITS(int16_t, INT16_MIN, INT16_MAX)
MSL_INT_LIMITS(uint16_t, 0, UINT16_MAX)
MSL_INT_LIMITS(int32_t, INT32_MIN, INT32_MAX)
MSL_INT_LIMITS(uint32_t, 0, UINT32_MAX)
MSL_INT_LIMITS(int64_t, INT64_MIN, INT64_MAX)
MSL_INT_LIMITS(uint64_t, 0, UINT64_MAX)
#undef MSL_INT_LIMITS

// ---- math. Each function exists for float, half and bfloat (computed in float,
// as the GPU does for bfloat) and element-wise for vectors of them.
template <typename T>
constexpr bool is_msl_float = __is_same(T, float) || __is_same(T, half) || __is_same(T, bfloat);

#define MSL_UNARY(name, f32)                                                  \
  METAL_FUNC float name(float x) { return f32(x); }                          \
  METAL_FUNC half name(half x) { return half(f32(float(x))); }              \
  METAL_FUNC bfloat name(bfloat x) { return bfloat(f32(float(x))); }        \
  METAL_FUNC float name(double x) { return f32(float(x)); }                 \
  template <typename T, int N>                                               \
  METAL_FUNC vec<T, N> name(vec<T, N> x) {                                   \
    vec<T, N> r;                                                             \
    for (int i = 0; i < N; ++i) r[i] = name(T(x[i]));                        \
    return r;                                                                \
  }
#define MSL_MATH_SET                                         \
  MSL_UNARY(exp, __builtin_expf)                             \
  MSL_UNARY(exp2, __builtin_exp2f)                           \
  MSL_UNARY(exp10, [](float v) { return __builtin_powf(10.0f, v); }) \
  MSL_UNARY(log, __builtin_logf)                             \
  MSL_UNARY(log2, __builtin_log2f)                           \
  MSL_UNARY(log10, __builtin_log10f)                         \
  MSL_UNARY(sqrt, __builtin_sqrtf)                           \
  MSL_UNARY(rsqrt, [](float v) { return 1.0f / __builtin_sqrtf(v); }) \
  MSL_UNARY(sin, __builtin_sinf)                             \
  MSL_UNARY(cos, __builtin_cosf)                             \
  MSL_UNARY(tan, __builtin_tanf)                             \
  MSL_UNARY(tanh, __builtin_tanhf)                           \
  MSL_UNARY(sinh, __builtin_sinhf)                           \
  MSL_UNARY(cosh, __builtin_coshf)                           \
  MSL_UNARY(asin, __builtin_asinf)                           \
  MSL_UNARY(acos, __builtin_acosf)                           \
  MSL_UNARY(atan, __builtin_atanf)                           \
  MSL_UNARY(erf, __builtin_erff)                             \
  MSL_UNARY(fabs, __builtin_fabsf)                           \
  MSL_UNARY(floor, __builtin_floorf)                         \
  MSL_UNARY(ceil, __builtin_ceilf)                           \
  MSL_UNARY(round, __builtin_roundf)                         \
  MSL_UNARY(rint, __builtin_rintf)                           \
  MSL_UNARY(trunc, __builtin_truncf)                         \
  METAL_FUNC float divide(float a, float b) { return a / b; } \
  METAL_FUNC float pow(float a, float b) { return __builtin_powf(a, b); } \
  METAL_FUNC float powr(float a, float b) { return __builtin_powf(a, b); } \
  METAL_FUNC float fmod(float a, float b) { return __builtin_fmodf(a, b); } \
  METAL_FUNC float atan2(float a, float b) { return __builtin_atan2f(a, b); }

MSL_MATH_SET
namespace fast {
MSL_MATH_SET
}
namespace precise {
MSL_MATH_SET
}
#undef MSL_MATH_SET
#undef MSL_UNARY

// abs/min/max/clamp/select work for every arithmetic scalar type and vectors.
template <typename T>
METAL_FUNC T abs(T x) {
  return x < T(0) ? T(-x) : x;
}
template <typename T>
METAL_FUNC T max(T a, T b) {
  if constexpr (is_msl_float<T>) {
    // Metal's fmax semantics: a NaN operand yields the other one.
    if (a != a) return b;
    if (b != b) return a;
  }
  return a > b ? a : b;
}
template <typename T>
METAL_FUNC T min(T a, T b) {
  if constexpr (is_msl_float<T>) {
    if (a != a) return b;
    if (b != b) return a;
  }
  return a < b ? a : b;
}
template <typename T, int N>
METAL_FUNC vec<T, N> max(vec<T, N> a, vec<T, N> b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = max(T(a[i]), T(b[i]));
  return r;
}
template <typename T, int N>
METAL_FUNC vec<T, N> min(vec<T, N> a, vec<T, N> b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = min(T(a[i]), T(b[i]));
  return r;
}
template <typename T>
METAL_FUNC T fmax(T a, T b) {
  return max(a, b);
}
template <typename T>
METAL_FUNC T fmin(T a, T b) {
  return min(a, b);
}
template <typename T>
METAL_FUNC T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <typename T>
METAL_FUNC T select(T a, T b, bool c) {
  return c ? b : a;
}
template <typename T>
METAL_FUNC T fma(T a, T b, T c) {
  return a * b + c;
}
template <typename T>
METAL_FUNC T mix(T x, T y, T a) {
  return x + (y - x) * a;
}
template <typename T>
METAL_FUNC bool isnan(T x) {
  return x != x;
}
template <typename T>
METAL_FUNC bool isinf(T x) {
  return float(x) == __builtin_inff() || float(x) == -__builtin_inff();
}
template <typename T>
METAL_FUNC bool isfinite(T x) {
  return !isnan(x) && !isinf(x);
}
template <typename T, int N>
METAL_FUNC T dot(vec<T, N> a, vec<T, N> b) {
  T s = T(0);
  for (int i = 0; i < N; ++i) s += a[i] * b[i];
  return s;
}

// ---- synchronisation
#define MSL_SITE_PARAMS \
  const char *msl_file_ = __builtin_FILE(), int msl_line_ = __builtin_LINE(), int msl_col_ = __builtin_COLUMN()
#define MSL_SITE(op) (msl_site{msl_file_, msl_line_, msl_col_, op})

METAL_FUNC void threadgroup_barrier(mem_flags, MSL_SITE_PARAMS) {
  msl_rt_barrier(MSL_SITE(msl_op_barrier));
}
METAL_FUNC void simdgroup_barrier(mem_flags, MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  char z = 0;
  msl_rt_simd_sync(&z, 1, MSL_SITE(msl_op_simd_barrier), &active, &lane);
}

namespace detail {
template <typename T>
METAL_FUNC T slot(const unsigned char* s, int lane) {
  T v;
  __builtin_memcpy(&v, s + lane * MSL_SIMD_SLOT, sizeof(T));
  return v;
}
template <typename T>
METAL_FUNC const unsigned char* sync(T x, msl_site site, uint32_t* active, int* lane) {
  static_assert(sizeof(T) <= MSL_SIMD_SLOT, "simd function on a type wider than 16 bytes");
  return msl_rt_simd_sync(&x, sizeof(T), site, active, lane);
}
template <typename T>
METAL_FUNC T from_lane(const unsigned char* s, uint32_t active, int src, msl_site site) {
  if (src < 0 || src >= MSL_SIMD_WIDTH || !((active >> src) & 1u))
    msl_rt_fail("simd shuffle/broadcast reads a lane that is not active", site);
  return slot<T>(s, src);
}
}  // namespace detail

#define MSL_REDUCE(name, op, init_expr, combine)                       \
  template <typename T>                                                \
  METAL_FUNC T name(T x, MSL_SITE_PARAMS) {                           \
    uint32_t active;                                                   \
    int lane;                                                          \
    const unsigned char* s = detail::sync(x, MSL_SITE(op), &active, &lane); \
    bool first = true;                                                 \
    T r = x;                                                           \
    for (int l = 0; l < MSL_SIMD_WIDTH; ++l) {                         \
      if (!((active >> l) & 1u)) continue;                             \
      T v = detail::slot<T>(s, l);                                     \
      if (first) { r = v; first = false; } else { r = combine; }       \
    }                                                                  \
    return r;                                                          \
  }
MSL_REDUCE(simd_sum, msl_op_simd_sum, 0, r + v)
MSL_REDUCE(simd_product, msl_op_simd_product, 1, r * v)
MSL_REDUCE(simd_max, msl_op_simd_max, 0, max(r, v))
MSL_REDUCE(simd_min, msl_op_simd_min, 0, min(r, v))
MSL_REDUCE(simd_and, msl_op_simd_and, 0, r & v)
MSL_REDUCE(simd_or, msl_op_simd_or, 0, r | v)
MSL_REDUCE(simd_xor, msl_op_simd_xor, 0, r ^ v)
#undef MSL_REDUCE

template <typename T>
METAL_FUNC T simd_prefix_inclusive_sum(T x, MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  const unsigned char* s = detail::sync(x, MSL_SITE(msl_op_simd_prefix_inclusive_sum), &active, &lane);
  T r = T(0);
  for (int l = 0; l <= lane; ++l)
    if ((active >> l) & 1u) r += detail::slot<T>(s, l);
  return r;
}
template <typename T>
METAL_FUNC T simd_prefix_exclusive_sum(T x, MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  const unsigned char* s = detail::sync(x, MSL_SITE(msl_op_simd_prefix_exclusive_sum), &active, &lane);
  T r = T(0);
  for (int l = 0; l < lane; ++l)
    if ((active >> l) & 1u) r += detail::slot<T>(s, l);
  return r;
}
template <typename T>
METAL_FUNC T simd_broadcast(T x, ushort src, MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  msl_site site = MSL_SITE(msl_op_simd_broadcast);
  const unsigned char* s = detail::sync(x, site, &active, &lane);
  return detail::from_lane<T>(s, active, src, site);
}
template <typename T>
METAL_FUNC T simd_shuffle(T x, ushort src, MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  msl_site site = MSL_SITE(msl_op_simd_shuffle);
  const unsigned char* s = detail::sync(x, site, &active, &lane);
  return detail::from_lane<T>(s, active, src, site);
}
template <typename T>
METAL_FUNC T simd_broadcast_first(T x, MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  const unsigned char* s = detail::sync(x, MSL_SITE(msl_op_simd_broadcast_first), &active, &lane);
  return detail::slot<T>(s, __builtin_ctz(active));
}
template <typename T>
METAL_FUNC T simd_shuffle_xor(T x, ushort mask, MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  msl_site site = MSL_SITE(msl_op_simd_shuffle_xor);
  const unsigned char* s = detail::sync(x, site, &active, &lane);
  return detail::from_lane<T>(s, active, lane ^ int(mask), site);
}
// Lanes whose source falls outside the simdgroup keep their own value (MSL spec).
template <typename T>
METAL_FUNC T simd_shuffle_down(T x, ushort delta, MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  msl_site site = MSL_SITE(msl_op_simd_shuffle_down);
  const unsigned char* s = detail::sync(x, site, &active, &lane);
  int src = lane + int(delta);
  return src >= MSL_SIMD_WIDTH ? x : detail::from_lane<T>(s, active, src, site);
}
template <typename T>
METAL_FUNC T simd_shuffle_up(T x, ushort delta, MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  msl_site site = MSL_SITE(msl_op_simd_shuffle_up);
  const unsigned char* s = detail::sync(x, site, &active, &lane);
  int src = lane - int(delta);
  return src < 0 ? x : detail::from_lane<T>(s, active, src, site);
}
METAL_FUNC bool simd_all(bool x, MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  const unsigned char* s = detail::sync(x, MSL_SITE(msl_op_simd_all), &active, &lane);
  for (int l = 0; l < MSL_SIMD_WIDTH; ++l)
    if (((active >> l) & 1u) && !detail::slot<bool>(s, l)) return false;
  return true;
}
METAL_FUNC bool simd_any(bool x, MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  const unsigned char* s = detail::sync(x, MSL_SITE(msl_op_simd_any), &active, &lane);
  for (int l = 0; l < MSL_SIMD_WIDTH; ++l)
    if (((active >> l) & 1u) && detail::slot<bool>(s, l)) return true;
  return false;
}
METAL_FUNC bool simd_is_first(MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  char z = 0;
  detail::sync(z, MSL_SITE(msl_op_simd_is_first), &active, &lane);
  return lane == __builtin_ctz(active);
}

// ---- simdgroup matrices (8x8). Every lane keeps the whole matrix; the operations
// are simdgroup-collective as on the GPU (all live lanes must reach the same call,
// else a deadlock is reported), and loads and stores move each element once: lane l
// loads/stores the two elements the GPU gives it (row fm, columns fn and fn + 1 with
// the mapping MLX's steel kernels use), and a load shares them through the runtime.
template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the harness models 8x8 simdgroup matrices");
  T e[64];  // row-major
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T v) {  // make_filled_simdgroup_matrix: every element
    for (int i = 0; i < 64; ++i) e[i] = v;
  }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <typename T, int C, int R>
METAL_FUNC simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T value) {
  return simdgroup_matrix<T, C, R>(value);
}

namespace detail {
// Row and first column of the two elements lane `lane` holds (MLX steel's BaseMMAFrag).
METAL_FUNC void mma_coord(int lane, int* row, int* col) {
  const int qid = lane / 4;
  *row = (qid & 4) + ((lane / 2) % 4);
  *col = (qid & 2) * 2 + (lane % 2) * 2;
}
METAL_FUNC int mma_index(int row, int col, unsigned long elements_per_row, ulong2 origin, bool transpose) {
  const unsigned long r = transpose ? (unsigned long)col : (unsigned long)row;
  const unsigned long c = transpose ? (unsigned long)row : (unsigned long)col;
  return int((origin.y + r) * elements_per_row + origin.x + c);
}
}  // namespace detail

template <typename T, int C, int R, typename P>
METAL_FUNC void simdgroup_load(thread simdgroup_matrix<T, C, R>& d, P src, unsigned long elements_per_row = 8,
                               ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false,
                               MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  // Find this lane's index first (a free sync would count as an operation): the
  // runtime's lane is the thread's position in its simdgroup.
  T mine[2];
  int row, col;
  detail::mma_coord(msl_rt_lane(), &row, &col);
  for (int k = 0; k < 2; ++k)
    mine[k] = T(src[detail::mma_index(row, col + k, elements_per_row, matrix_origin, transpose_matrix)]);
  const unsigned char* s = msl_rt_simd_sync(mine, sizeof mine, MSL_SITE(msl_op_simdgroup_load), &active, &lane);
  if (active != 0xffffffffu) msl_rt_fail("simdgroup_load needs all 32 lanes of the simdgroup", MSL_SITE(msl_op_simdgroup_load));
  for (int l = 0; l < 32; ++l) {
    int lr, lc;
    detail::mma_coord(l, &lr, &lc);
    T pair[2];
    __builtin_memcpy(pair, s + l * MSL_SIMD_SLOT, sizeof pair);
    d.e[lr * 8 + lc] = pair[0];
    d.e[lr * 8 + lc + 1] = pair[1];
  }
}

template <typename T, int C, int R, typename P>
METAL_FUNC void simdgroup_store(simdgroup_matrix<T, C, R> a, P dst, unsigned long elements_per_row = 8,
                                ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false,
                                MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  char z = 0;
  msl_rt_simd_sync(&z, 1, MSL_SITE(msl_op_simdgroup_store), &active, &lane);
  if (active != 0xffffffffu) msl_rt_fail("simdgroup_store needs all 32 lanes of the simdgroup", MSL_SITE(msl_op_simdgroup_store));
  int row, col;
  detail::mma_coord(lane, &row, &col);
  for (int k = 0; k < 2; ++k)
    dst[detail::mma_index(row, col + k, elements_per_row, matrix_origin, transpose_matrix)] = a.e[row * 8 + col + k];
}

// d = a * b + c, accumulated in float (as the GPU does for half and bfloat inputs).
template <typename T, typename U, typename V, typename W, int N>
METAL_FUNC void simdgroup_multiply_accumulate(thread simdgroup_matrix<T, N, N>& d, simdgroup_matrix<U, N, N> a,
                                              simdgroup_matrix<V, N, N> b, simdgroup_matrix<W, N, N> c,
                                              MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  char z = 0;
  msl_rt_simd_sync(&z, 1, MSL_SITE(msl_op_simdgroup_multiply_accumulate), &active, &lane);
  if (active != 0xffffffffu)
    msl_rt_fail("simdgroup_multiply_accumulate needs all 32 lanes", MSL_SITE(msl_op_simdgroup_multiply_accumulate));
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) {
      float acc = float(c.e[i * 8 + j]);
      for (int k = 0; k < 8; ++k) acc += float(a.e[i * 8 + k]) * float(b.e[k * 8 + j]);
      d.e[i * 8 + j] = T(acc);
    }
}
template <typename T, typename U, typename V, int N>
METAL_FUNC void simdgroup_multiply(thread simdgroup_matrix<T, N, N>& d, simdgroup_matrix<U, N, N> a,
                                   simdgroup_matrix<V, N, N> b, MSL_SITE_PARAMS) {
  uint32_t active;
  int lane;
  char z = 0;
  msl_rt_simd_sync(&z, 1, MSL_SITE(msl_op_simdgroup_multiply), &active, &lane);
  if (active != 0xffffffffu) msl_rt_fail("simdgroup_multiply needs all 32 lanes", MSL_SITE(msl_op_simdgroup_multiply));
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) {
      float acc = 0.0f;
      for (int k = 0; k < 8; ++k) acc += float(a.e[i * 8 + k]) * float(b.e[k * 8 + j]);
      d.e[i * 8 + j] = T(acc);
    }
}

// ---- atomics (for `atomic_outputs=True`). Fibers never run at the same time, so
// plain loads and stores are atomic here.
template <typename T>
struct atomic {
  T value;
};
template <typename T, typename U>
METAL_FUNC T atomic_fetch_add_explicit(device atomic<T>* a, U v, memory_order) {
  T old = a->value;
  a->value = old + T(v);
  return old;
}
template <typename T, typename U>
METAL_FUNC T atomic_fetch_max_explicit(device atomic<T>* a, U v, memory_order) {
  T old = a->value;
  a->value = max(old, T(v));
  return old;
}
template <typename T, typename U>
METAL_FUNC T atomic_fetch_min_explicit(device atomic<T>* a, U v, memory_order) {
  T old = a->value;
  a->value = min(old, T(v));
  return old;
}
template <typename T>
METAL_FUNC T atomic_load_explicit(device atomic<T>* a, memory_order) {
  return a->value;
}
template <typename T, typename U>
METAL_FUNC void atomic_store_explicit(device atomic<T>* a, U v, memory_order) {
  a->value = T(v);
}

}  // namespace metal

using namespace metal;

// ---- stand-ins for the parts of MLX's kernels/utils.h that kernels use
typedef half float16_t;
typedef bfloat bfloat16_t;

template <typename U>
struct Limits {
  static constexpr U max = metal::numeric_limits<U>::max();
  static constexpr U min = metal::numeric_limits<U>::min();
  static constexpr U finite_max = metal::numeric_limits<U>::max();
  static constexpr U finite_min = metal::numeric_limits<U>::min();
};
#define MSL_FLOAT_LIMIT(T)                                                 \
  template <>                                                              \
  struct Limits<T> {                                                       \
    static constexpr T max = metal::numeric_limits<T>::infinity();        \
    static constexpr T min = -metal::numeric_limits<T>::infinity();       \
    static constexpr T finite_max = metal::numeric_limits<T>::max();      \
    static constexpr T finite_min = metal::numeric_limits<T>::lowest();   \
  };
MSL_FLOAT_LIMIT(float)
MSL_FLOAT_LIMIT(half)
MSL_FLOAT_LIMIT(bfloat)
#undef MSL_FLOAT_LIMIT

template <typename U>
struct WorkPerThread {
  static constexpr int n = 8 / sizeof(U);
};

template <typename T, typename U>
inline T ceildiv(T N, U M) {
  return (N + M - 1) / M;
}

template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc(IdxT elem, constant const int* shape, constant const int64_t* strides,
                            int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}

template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc(uint3 elem, constant const int* shape, constant const int64_t* strides,
                            int ndim) {
  IdxT loc = elem.x * IdxT(strides[ndim - 1]) + elem.y * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += (elem.z % shape[d]) * IdxT(strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}
