// paged_attention_decode: one query token per sequence over its paged K/V.
//
// File layout (all kernels in metal_kernels/): text before "// --- header ---" is
// documentation and is not compiled; the lines between "// --- header ---" and
// "// --- body ---" are passed as `header=` to mx.fast.metal_kernel; the lines after
// "// --- body ---" are the kernel body (`source=`). MLX adds an attribute argument
// whenever its name appears anywhere in the body, comments included, so body
// comments avoid naming attributes the body does not use.
//
// Algorithm: vLLM's paged attention v1/v2 (Kwon et al., SOSP 2023) with the
// online softmax of Milakov & Gimelshein (2018) / FlashAttention: float32 running
// max, sum and output per simdgroup, merged across simdgroups in threadgroup memory.
//
// Launch (built by mlx_ferrum/kernels/metal.py):
//   grid        = (num_heads * NUM_SIMD * 32, num_seqs, num_partitions) threads
//   threadgroup = (NUM_SIMD * 32, 1, 1): one group per (head, sequence, partition)
// Inputs:
//   q            [num_seqs, num_heads, HEAD_DIM]                  T
//   k_pool       [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM] T
//   v_pool       same as k_pool
//   block_tables [num_seqs * max_blocks_per_seq] int32, padded to >= 8 elements
//   context_lens [num_seqs] int32, padded to >= 8 elements
//   params       [8] int32: num_heads, num_kv_heads, max_blocks_per_seq, num_partitions
//   scale        0-d float32 (softmax scale)
// Outputs:
//   out          PARTITION_SIZE == 0: [num_seqs, num_heads, HEAD_DIM] OutT (= T), final.
//                PARTITION_SIZE  > 0: [num_seqs, num_heads, num_partitions, HEAD_DIM]
//                float, each partition's normalised partial output.
//   max_logits   [num_seqs, num_heads, num_partitions] float (unused when PARTITION_SIZE == 0)
//   exp_sums     same shape: sum of exp(logit - max_logit) over the partition
// Template: T, OutT, HEAD_DIM (multiple of 8, <= 256), BLOCK_SIZE, NUM_SIMD,
//   PARTITION_SIZE (tokens per partition, a multiple of BLOCK_SIZE; 0 = one pass).
//
// Within a simdgroup, LPT lanes share one token (each owns HEAD_DIM / LPT dims,
// strided by LPT so neighbouring lanes read neighbouring elements), so 32 / LPT
// tokens are scored per step. Simdgroup w walks blocks w, w + NUM_SIMD, ...
// --- header ---
// Lanes that share one token's dot product: the largest power of two <= 32 that
// divides head_dim, so the dims split evenly and the lane groups align with
// simd_shuffle_xor butterflies.
constexpr int pa_lanes_per_token(int head_dim) {
  int lanes = 32;
  while (lanes > 1 && head_dim % lanes != 0) {
    lanes /= 2;
  }
  return lanes;
}
// --- body ---
  constexpr int LPT = pa_lanes_per_token(HEAD_DIM);
  constexpr int TPS = 32 / LPT;
  constexpr int EPL = HEAD_DIM / LPT;
  constexpr int TG = NUM_SIMD * 32;

  threadgroup float sg_max[NUM_SIMD];
  threadgroup float sg_sum[NUM_SIMD];
  threadgroup float sg_acc[NUM_SIMD * HEAD_DIM];

  const int num_heads = params[0];
  const int num_kv_heads = params[1];
  const int max_blocks = params[2];
  const int num_partitions = params[3];
  const int head = threadgroup_position_in_grid.x;
  const int seq = threadgroup_position_in_grid.y;
  const int part = threadgroup_position_in_grid.z;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int lane = thread_index_in_simdgroup;
  const int sg = simdgroup_index_in_threadgroup;
  const int tid = thread_index_in_threadgroup;
  const int tok_group = lane / LPT;
  const int r = lane % LPT;

  const int ctx = context_lens[seq];
  int tok_begin = 0;
  int tok_end = ctx;
  if (PARTITION_SIZE > 0) {
    tok_begin = part * PARTITION_SIZE;
    tok_end = min(ctx, tok_begin + PARTITION_SIZE);
  }

  const int64_t row = int64_t(seq) * num_heads + head;
  float qv[EPL];
  float acc[EPL];
  for (int i = 0; i < EPL; ++i) {
    qv[i] = float(q[row * HEAD_DIM + r + i * LPT]) * scale;
    acc[i] = 0.0f;
  }
  float m = -INFINITY;
  float l = 0.0f;

  const int64_t head_stride = int64_t(BLOCK_SIZE) * HEAD_DIM;
  const int64_t block_stride = head_stride * num_kv_heads;
  const int first_block = tok_begin / BLOCK_SIZE;
  const int end_block = tok_end > tok_begin ? (tok_end + BLOCK_SIZE - 1) / BLOCK_SIZE : first_block;
  for (int b = first_block + sg; b < end_block; b += NUM_SIMD) {
    const int physical_block = block_tables[int64_t(seq) * max_blocks + b];
    const int64_t base = physical_block * block_stride + kv_head * head_stride;
    for (int t0 = 0; t0 < BLOCK_SIZE; t0 += TPS) {
      const int t = t0 + tok_group;
      const int tok = b * BLOCK_SIZE + t;
      const bool valid = t < BLOCK_SIZE && tok >= tok_begin && tok < tok_end;
      float s = 0.0f;
      if (valid) {
        for (int i = 0; i < EPL; ++i) {
          s += qv[i] * float(k_pool[base + t * HEAD_DIM + r + i * LPT]);
        }
      }
      for (int o = LPT / 2; o > 0; o /= 2) {
        s += simd_shuffle_xor(s, ushort(o));
      }
      s = valid ? s : -INFINITY;
      // Tokens are visited in order, so a step with no valid token ends the block.
      const float step_max = simd_max(s);
      if (step_max == -INFINITY) {
        break;
      }
      const float m_new = max(m, step_max);
      const float correction = exp(m - m_new);
      const float p = valid ? exp(s - m_new) : 0.0f;
      l = l * correction + simd_sum(r == 0 ? p : 0.0f);
      for (int i = 0; i < EPL; ++i) {
        // Slots past the context may hold garbage (even NaN): never multiply them.
        const float v = valid ? float(v_pool[base + t * HEAD_DIM + r + i * LPT]) : 0.0f;
        acc[i] = acc[i] * correction + p * v;
      }
      m = m_new;
    }
  }

  // Lanes with the same r hold partial sums for the same dims: add across token groups.
  for (int o = LPT; o < 32; o *= 2) {
    for (int i = 0; i < EPL; ++i) {
      acc[i] += simd_shuffle_xor(acc[i], ushort(o));
    }
  }
  if (lane == 0) {
    sg_max[sg] = m;
    sg_sum[sg] = l;
  }
  if (tok_group == 0) {
    for (int i = 0; i < EPL; ++i) {
      sg_acc[sg * HEAD_DIM + r + i * LPT] = acc[i];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float m_all = -INFINITY;
  for (int w = 0; w < NUM_SIMD; ++w) {
    m_all = max(m_all, float(sg_max[w]));
  }
  float weight[NUM_SIMD];
  float l_all = 0.0f;
  for (int w = 0; w < NUM_SIMD; ++w) {
    weight[w] = sg_max[w] == -INFINITY ? 0.0f : exp(sg_max[w] - m_all);
    l_all += sg_sum[w] * weight[w];
  }
  const float inv_l = l_all > 0.0f ? 1.0f / l_all : 0.0f;
  for (int d = tid; d < HEAD_DIM; d += TG) {
    float o = 0.0f;
    for (int w = 0; w < NUM_SIMD; ++w) {
      o += weight[w] * sg_acc[w * HEAD_DIM + d];
    }
    if (PARTITION_SIZE == 0) {
      out[row * HEAD_DIM + d] = static_cast<OutT>(o * inv_l);
    } else {
      out[(row * num_partitions + part) * HEAD_DIM + d] = static_cast<OutT>(o * inv_l);
    }
  }
  if (PARTITION_SIZE > 0 && tid == 0) {
    max_logits[row * num_partitions + part] = m_all;
    exp_sums[row * num_partitions + part] = l_all;
  }
