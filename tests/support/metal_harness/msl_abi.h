// Types shared by the MSL compatibility header (kernel side) and the fiber
// runtime (host side). It defines no macros, so the runtime can include it next
// to the C++ standard library.
#pragma once

#include <stddef.h>
#include <stdint.h>

typedef unsigned int msl_uint3 __attribute__((ext_vector_type(3)));

// The values of every Metal kernel attribute MLX can add to a signature, named
// exactly as the attribute, so the generated entry point can pass `a->NAME`.
struct msl_thread_attrs {
  unsigned int dispatch_quadgroups_per_threadgroup;
  unsigned int dispatch_simdgroups_per_threadgroup;
  msl_uint3 dispatch_threads_per_threadgroup;
  msl_uint3 grid_origin;
  msl_uint3 grid_size;
  unsigned int quadgroup_index_in_threadgroup;
  unsigned int quadgroups_per_threadgroup;
  unsigned int simdgroup_index_in_threadgroup;
  unsigned int simdgroups_per_threadgroup;
  unsigned int thread_execution_width;
  unsigned int thread_index_in_quadgroup;
  unsigned int thread_index_in_simdgroup;
  unsigned int thread_index_in_threadgroup;
  msl_uint3 thread_position_in_grid;
  msl_uint3 thread_position_in_threadgroup;
  msl_uint3 threadgroup_position_in_grid;
  msl_uint3 threadgroups_per_grid;
  msl_uint3 threads_per_grid;
  unsigned int threads_per_simdgroup;
  msl_uint3 threads_per_threadgroup;
};

// A call site of a synchronising function, captured through default arguments
// (__builtin_FILE/LINE/COLUMN) so that #line directives point into the .metal file.
struct msl_site {
  const char* file;
  int line;
  int column;
  int op;  // which function (msl_op_*), so two different calls never match
};

enum {
  msl_op_barrier = 1,
  msl_op_simd_barrier,
  msl_op_simd_sum,
  msl_op_simd_product,
  msl_op_simd_max,
  msl_op_simd_min,
  msl_op_simd_and,
  msl_op_simd_or,
  msl_op_simd_xor,
  msl_op_simd_prefix_inclusive_sum,
  msl_op_simd_prefix_exclusive_sum,
  msl_op_simd_broadcast,
  msl_op_simd_broadcast_first,
  msl_op_simd_shuffle,
  msl_op_simd_shuffle_xor,
  msl_op_simd_shuffle_up,
  msl_op_simd_shuffle_down,
  msl_op_simd_all,
  msl_op_simd_any,
  msl_op_simd_is_first,
  msl_op_simdgroup_load,
  msl_op_simdgroup_store,
  msl_op_simdgroup_multiply_accumulate,
  msl_op_simdgroup_multiply,
};

// One lane's deposit at a simdgroup function: up to 16 bytes (a float4 or a long).
#define MSL_SIMD_SLOT 16
#define MSL_SIMD_WIDTH 32

#ifdef __cplusplus
extern "C" {
#endif
// Deposit this lane's value at `site` and block (switch fibers) until every live
// lane of the simdgroup has reached the same call. Returns the 32 deposited slots;
// *active gets the mask of live lanes and *lane this lane's index.
const unsigned char* msl_rt_simd_sync(const void* value, int size, struct msl_site site,
                                      uint32_t* active, int* lane);
// This thread's index in its simdgroup (no synchronisation).
int msl_rt_lane(void);
// Block until every live thread of the threadgroup reaches a barrier at `site`.
void msl_rt_barrier(struct msl_site site);
// Called where a `threadgroup` variable is declared: the first thread of each
// threadgroup to get there fills it with NaN bytes (0xFF).
void msl_rt_tg_register(void* p, size_t bytes, const char* file, int line);
// Abort the launch with a message naming `site` (e.g. a shuffle from an inactive lane).
void msl_rt_fail(const char* msg, struct msl_site site) __attribute__((noreturn));
#ifdef __cplusplus
}
#endif
