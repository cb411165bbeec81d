// paged_attention_decode: one query token per sequence over its paged K/V, all the
// query heads of one KV head together (GQA packing).
//
// File layout (all kernels in metal_kernels/): text before "// --- header ---" is
// documentation and is not compiled; the lines between "// --- header ---" and
// "// --- body ---" are passed as `header=` to mx.fast.metal_kernel; the lines after
// "// --- body ---" are the kernel body (`source=`). MLX adds an attribute argument
// whenever its name appears anywhere in the body, comments included, so body
// comments avoid naming attributes the body does not use.
//
// Algorithm: vLLM's paged attention v1/v2 (Kwon et al., SOSP 2023) with the
// online softmax of Milakov & Gimelshein (2018) / FlashAttention, computed in base 2
// (q pre-scaled by scale * log2(e), exp2), with the GQA packing of MLX's
// sdpa_vector_2pass_1_gqa: one threadgroup per (sequence, KV head[, partition]) serves
// GQA query heads of that KV head from the same K/V loads (all of them when the group
// has at most 8; else the group is split over threadgroups of GQA heads each).
//
// Launch (built by mlx_ferrum/kernels/metal.py):
//   grid        = (num_heads / GQA * NUM_SIMD * 32, num_seqs, num_partitions) threads
//   threadgroup = (NUM_SIMD * 32, 1, 1)
// Inputs:
//   q            [num_seqs, num_kv_heads * GQA, HEAD_DIM]         T
//   k_pool       KV_BITS == 0: [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM] T;
//                KV_BITS == 8: the same shape, int8 codes;
//                KV_BITS == 4: [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM / 2] uint8,
//                two codes per byte (element 2i in the low nibble, 2i + 1 in the high)
//   v_pool       same as k_pool
//   k_scales     KV_BITS != 0: [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM / GROUP_SIZE]
//                half, one scale per group of GROUP_SIZE consecutive elements of a row;
//                KV_BITS == 0: [8] placeholder, unread
//   v_scales     same as k_scales
//   k_biases     KV_BITS == 4: same as k_scales (the groups' minima); else [8], unread
//   v_biases     same as k_biases
//   block_tables [num_seqs * max_blocks_per_seq] int32, padded to >= 8 elements
//   context_lens [num_seqs] int32, padded to >= 8 elements
//   params       [8] int32: num_heads, num_kv_heads, max_blocks_per_seq, num_partitions,
//                window (sliding window in tokens; 0 = none)
//   scale        0-d float32: softmax scale times log2(e)
//   sinks        [max(8, num_heads)] float32: attention-sink logits times log2(e)
//                (read only when SINKS == 1 and PARTITION_SIZE == 0; split-K adds
//                them in paged_attention_reduce)
//   code_bounds  FLOAT_FIRST > 0: [num_seqs * 2] int32 (padded to >= 8 elements), per
//                sequence (code_end, float_from): the codes of positions >= code_end,
//                and of positions < FLOAT_FIRST that are >= float_from, score nothing
//                (the caller reads them from its float window); FLOAT_FIRST == 0: [8], unread
// Outputs:
//   out          PARTITION_SIZE == 0: [num_seqs, num_heads, HEAD_DIM] OutT (= T), final.
//                PARTITION_SIZE  > 0: [num_seqs, num_heads, num_partitions, HEAD_DIM]
//                float, each partition's normalised partial output.
//   max_logits   [num_seqs, num_heads, num_partitions] float, in log2 units
//                (unused when PARTITION_SIZE == 0)
//   exp_sums     same shape: sum of exp2(logit - max_logit) over the partition
// Template: T, OutT, HEAD_DIM (multiple of 8, <= 256), BLOCK_SIZE (power of two >= 8),
//   KV_BITS (0: the pools hold T; 8: int8 codes, x = code * scale; 4: uint4 codes,
//   x = code * scale + bias), GROUP_SIZE (elements per scale, a multiple of 8 dividing
//   HEAD_DIM; HEAD_DIM when KV_BITS == 0),
//   NUM_SIMD, GQA (query heads per threadgroup: num_heads / num_kv_heads, or a divisor of
//   it when that is above 8), PARTITION_SIZE (tokens per partition, a
//   multiple of BLOCK_SIZE; 0 = one pass), SINKS (1: add the sink logit of each query
//   head to the softmax denominator, gpt-oss; 0: none), FLOAT_FIRST (0: every position
//   is read from the pools; > 0: the float window's first tokens, see code_bounds).
//
// Float window (int4 caches, mlx_ferrum.kernels.float_window): each query's most recent
// positions and its sequence's first FLOAT_FIRST positions are attended by the caller
// from float copies, in the same softmax. The kernel then skips those positions' codes
// (the recent ones are the tail of the context, so the block loop simply ends at
// code_end) and is launched split-K, so that the caller merges the partitions' max and
// sum with the float entries' own (in mlx_ferrum.kernels.metal).
//
// Sliding window (Mistral; gpt-oss's even layers): the query at position ctx - 1
// attends keys [ctx - window, ctx). The block loop starts at the block holding
// ctx - window, so blocks wholly before the window are never read (work and traffic
// grow with the window, not the context); the tokens of that first block before the
// window are masked like tokens past the context. A partition wholly before the
// window reads nothing and reports an empty state (max -FLT_MAX, sum 0).
// Sinks (gpt-oss): one extra logit per query head in the denominator, with no value:
// out = sum_t exp2(s_t - M) v_t / (sum_t exp2(s_t - M) + exp2(sink - M)),
// M = max(max_t s_t, sink).
//
// Work split: a K or V row is read as 16-byte vectors (VEC elements). LPT lanes share a
// token (at most 8, so the score needs log2(LPT) <= 3 shuffles for 32 / LPT tokens);
// lane r owns the vectors r, r + LPT, ... of the row, so neighbouring lanes read
// neighbouring 16 bytes. Each group of LPT lanes keeps its own running max, sum and
// output per query head for the tokens it scores (no cross-lane max or sum per token);
// the groups are merged once at the end in threadgroup memory.
// The GQA query rows and the block ids (per chunk of 32 blocks) are read from device
// memory once per threadgroup, into threadgroup memory.
// Quantized pools (KV_BITS 8 or 4; the storage contract of mlx_ferrum's quantized KV
// cache): a lane reads its vectors as 8 codes (8 bytes of int8, or 4 bytes of packed
// nibbles) and dequantizes them in registers; no float copy of K or V is written.
// At step j the LPT lanes of a token hold consecutive vectors; the SHARE of them in one
// scale group (with the contract's group size, the largest power of two <= 64 dividing
// HEAD_DIM, GROUP_SIZE = LPT * 8: one group per step) get its scale (and bias) from the
// first of them by simd_shuffle, so each is read from device memory once. Keys of int4 caches are stored
// rotated (k H, H a normalised Walsh-Hadamard matrix): the caller passes q H as q, and
// q H . k H = q . k. Values are never rotated.
// No +-infinity anywhere (safe under fast math): the running max starts at -FLT_MAX,
// the number of rounds is computed up front, tokens outside [window start, context)
// score nothing.
// --- header ---
// Elements of T in one 16-byte load.
template <typename T>
constexpr int pa_vec_elements() {
  return int(16 / sizeof(T));
}
// Lanes that share one token: the largest power of two <= 8 dividing the vectors of a
// row, so the lane groups align with simd_shuffle_xor butterflies.
constexpr int pa_lanes_per_token(int vectors) {
  int lanes = 8;
  while (lanes > 1 && vectors % lanes != 0) {
    lanes /= 2;
  }
  return lanes;
}
// Token groups per simdgroup kept apart until the threadgroup merge: as many as fit
// 16 KiB of threadgroup memory (the rest are merged by shuffles first).
constexpr int pa_groups_kept(int groups_per_simd, int num_simd, int head_dim) {
  int keep = groups_per_simd;
  while (keep > 1 && num_simd * keep * head_dim * 4 > 16384) {
    keep /= 2;
  }
  return keep;
}
// 16 bytes of T widened to float.
METAL_FUNC void pa_unpack(uint4 raw, thread float* out, float) {
  for (int i = 0; i < 4; ++i) {
    out[i] = as_type<float>(raw[i]);
  }
}
METAL_FUNC void pa_unpack(uint4 raw, thread float* out, half) {
  for (int i = 0; i < 4; ++i) {
    const half2 h = as_type<half2>(raw[i]);
    out[2 * i] = float(h.x);
    out[2 * i + 1] = float(h.y);
  }
}
METAL_FUNC void pa_unpack(uint4 raw, thread float* out, bfloat) {
  for (int i = 0; i < 4; ++i) {
    const bfloat2 h = as_type<bfloat2>(raw[i]);
    out[2 * i] = float(h.x);
    out[2 * i + 1] = float(h.y);
  }
}
// 8 quantized codes at p (dequantized as code * s + b) into out[0..8). The fp
// overload is never called (KV_BITS == 0 reads the pools with pa_unpack) but compiles.
template <typename C>
METAL_FUNC void pa_dequant(const device C*, bool, float, float, thread float* out) {
  for (int i = 0; i < 8; ++i) {
    out[i] = 0.0f;
  }
}
// int8: 8 bytes of signed codes, symmetric (b is 0).
METAL_FUNC void pa_dequant(const device int8_t* p, bool valid, float s, float, thread float* out) {
  uint2 raw = uint2(0);
  if (valid) {
    raw = *(const device uint2*)p;
  }
  for (int w = 0; w < 2; ++w) {
    const char4 c = as_type<char4>(raw[w]);
    for (int i = 0; i < 4; ++i) {
      out[4 * w + i] = float(c[i]) * s;
    }
  }
}
// int4: 4 bytes of nibbles, element e in bits 4e .. 4e + 3 (byte j: elements 2j low, 2j + 1 high).
METAL_FUNC void pa_dequant(const device uint8_t* p, bool valid, float s, float b, thread float* out) {
  uint raw = 0;
  if (valid) {
    raw = *(const device uint*)p;
  }
  for (int e = 0; e < 8; ++e) {
    out[e] = float((raw >> (4 * e)) & 0xFu) * s + b;
  }
}
// --- body ---
  constexpr int VEC = KV_BITS == 0 ? pa_vec_elements<T>() : 8;
  // Pool elements per token row, and per VEC-element vector of it.
  constexpr int ROW = KV_BITS == 4 ? HEAD_DIM / 2 : HEAD_DIM;
  constexpr int VEC_CODES = VEC * ROW / HEAD_DIM;
  constexpr int NG = HEAD_DIM / GROUP_SIZE;
  constexpr int NV = HEAD_DIM / VEC;
  constexpr int LPT = pa_lanes_per_token(NV);
  constexpr int VPL = NV / LPT;
  constexpr int EPL = VPL * VEC;
  constexpr int TPS = 32 / LPT;
  constexpr int TG = NUM_SIMD * 32;
  constexpr int ROUND = NUM_SIMD * TPS;
  constexpr int CHUNK = 32;
  constexpr int KEEP = pa_groups_kept(TPS, NUM_SIMD, HEAD_DIM);
  constexpr int GROUPS = NUM_SIMD * KEEP;
  // Lanes of a token whose vectors of one step j lie in the same scale group.
  constexpr int SHARE = GROUP_SIZE / VEC < LPT ? GROUP_SIZE / VEC : LPT;

  threadgroup float q_shared[GQA * HEAD_DIM];
  threadgroup int block_ids[CHUNK];
  threadgroup float group_max[GROUPS];
  threadgroup float group_sum[GROUPS];
  threadgroup float group_acc[GROUPS * HEAD_DIM];

  const int num_heads = params[0];
  const int num_kv_heads = params[1];
  const int max_blocks = params[2];
  const int num_partitions = params[3];
  const int window = params[4];
  const int head_group = threadgroup_position_in_grid.x;  // query heads head_group * GQA + [0, GQA)
  const int kv_head = head_group / ((num_heads / num_kv_heads) / GQA);
  const int seq = threadgroup_position_in_grid.y;
  const int part = threadgroup_position_in_grid.z;
  const int lane = thread_index_in_simdgroup;
  const int sg = simdgroup_index_in_threadgroup;
  const int tid = thread_index_in_threadgroup;
  const int tok_group = lane / LPT;
  const int r = lane % LPT;

  if (PARTITION_SIZE == 0 && head_group == 0 && seq == 0 && tid == 0) {
    // The one-pass launch's statistics outputs are 1-element placeholders: write
    // them once, so every output element is written exactly once.
    max_logits[0] = 0.0f;
    exp_sums[0] = 0.0f;
  }
  const int ctx = context_lens[seq];
  const int window_begin = window > 0 ? max(0, ctx - window) : 0;
  // The float window's positions: the context's tail from code_end on, and the first
  // FLOAT_FIRST positions from float_from on, are the caller's.
  const int code_end = FLOAT_FIRST > 0 ? max(0, min(ctx, code_bounds[2 * seq])) : ctx;
  const int float_from = FLOAT_FIRST > 0 ? code_bounds[2 * seq + 1] : ctx;
  int tok_end = code_end;
  int tok_begin = min(window_begin, tok_end);
  if (PARTITION_SIZE > 0) {
    const int part_begin = min(ctx, part * PARTITION_SIZE);
    tok_end = min(code_end, part_begin + PARTITION_SIZE);
    tok_begin = min(tok_end, max(part_begin, window_begin));
  }
  const int first_block = tok_begin / BLOCK_SIZE;
  const int num_blocks = (tok_end - first_block * BLOCK_SIZE + BLOCK_SIZE - 1) / BLOCK_SIZE;
  const int num_chunks = (num_blocks + CHUNK - 1) / CHUNK;

  const int64_t q_row = int64_t(seq) * num_heads + int64_t(head_group) * GQA;
  // The GQA query rows are read from device memory once, then shared.
  for (int i = tid; i < GQA * HEAD_DIM; i += TG) {
    q_shared[i] = float(q[q_row * HEAD_DIM + i]) * scale;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float qv[GQA * EPL];
  float acc[GQA * EPL];
  float m[GQA];
  float l[GQA];
  for (int h = 0; h < GQA; ++h) {
    for (int j = 0; j < VPL; ++j) {
      for (int e = 0; e < VEC; ++e) {
        const int d = (r + j * LPT) * VEC + e;
        qv[h * EPL + j * VEC + e] = q_shared[h * HEAD_DIM + d];
        acc[h * EPL + j * VEC + e] = 0.0f;
      }
    }
    m[h] = -FLT_MAX;
    l[h] = 0.0f;
  }

  const int64_t head_stride = int64_t(BLOCK_SIZE) * ROW;
  const int64_t block_stride = head_stride * num_kv_heads;
  const int64_t kv_offset = int64_t(kv_head) * head_stride;
  const int64_t scale_head_stride = int64_t(BLOCK_SIZE) * NG;
  const int64_t scale_block_stride = scale_head_stride * num_kv_heads;
  const int64_t scale_offset = int64_t(kv_head) * scale_head_stride;
  // The scale group of each of this lane's vectors.
  int vec_group[VPL];
  for (int j = 0; j < VPL; ++j) {
    vec_group[j] = ((r + j * LPT) * VEC) / GROUP_SIZE;
  }
  for (int c = 0; c < num_chunks; ++c) {
    const int chunk_block = first_block + c * CHUNK;
    for (int i = tid; i < CHUNK; i += TG) {
      block_ids[i] = chunk_block + i < first_block + num_blocks
          ? block_tables[int64_t(seq) * max_blocks + chunk_block + i] : 0;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int chunk_tok = chunk_block * BLOCK_SIZE;
    const int rounds = (min(CHUNK * BLOCK_SIZE, tok_end - chunk_tok) + ROUND - 1) / ROUND;
    for (int k = 0; k < rounds; ++k) {
      const int local = k * ROUND + sg * TPS + tok_group;
      const int pos = chunk_tok + local;
      const bool valid = pos < tok_end && pos >= tok_begin && (pos >= FLOAT_FIRST || pos < float_from);
      const int64_t row = int64_t(block_ids[local / BLOCK_SIZE]) * block_stride + kv_offset
          + int64_t(local % BLOCK_SIZE) * ROW;
      // Quantized pools: the scales (and biases) of this lane's vectors of K and V.
      float k_scale[VPL];
      float v_scale[VPL];
      float k_bias[VPL];
      float v_bias[VPL];
      if (KV_BITS != 0) {
        const int64_t scale_row = int64_t(block_ids[local / BLOCK_SIZE]) * scale_block_stride + scale_offset
            + int64_t(local % BLOCK_SIZE) * NG;
        // The first of the SHARE lanes of a group reads its scale (and bias); the others
        // take them by shuffle, so each is read from device memory once per step.
        const bool reads = valid && r % SHARE == 0;
        const ushort reader = ushort(lane - lane % SHARE);
        for (int j = 0; j < VPL; ++j) {
          const int64_t at = scale_row + vec_group[j];
          k_scale[j] = reads ? float(k_scales[at]) : 0.0f;
          v_scale[j] = reads ? float(v_scales[at]) : 0.0f;
          k_bias[j] = reads && KV_BITS == 4 ? float(k_biases[at]) : 0.0f;
          v_bias[j] = reads && KV_BITS == 4 ? float(v_biases[at]) : 0.0f;
          if (SHARE > 1) {
            k_scale[j] = simd_shuffle(k_scale[j], reader);
            v_scale[j] = simd_shuffle(v_scale[j], reader);
            if (KV_BITS == 4) {
              k_bias[j] = simd_shuffle(k_bias[j], reader);
              v_bias[j] = simd_shuffle(v_bias[j], reader);
            }
          }
        }
      }
      float kf[EPL];
      for (int j = 0; j < VPL; ++j) {
        if (KV_BITS == 0) {
          uint4 raw = uint4(0);
          if (valid) {
            raw = *(const device uint4*)(k_pool + row + (r + j * LPT) * VEC);
          }
          pa_unpack(raw, kf + j * VEC, T(0));
        } else {
          pa_dequant(k_pool + row + (r + j * LPT) * VEC_CODES, valid, k_scale[j], k_bias[j], kf + j * VEC);
        }
      }
      float s[GQA];
      for (int h = 0; h < GQA; ++h) {
        float dot = 0.0f;
        for (int i = 0; i < EPL; ++i) {
          dot += qv[h * EPL + i] * kf[i];
        }
        s[h] = dot;
      }
      for (int o = LPT / 2; o > 0; o /= 2) {
        for (int h = 0; h < GQA; ++h) {
          s[h] += simd_shuffle_xor(s[h], ushort(o));
        }
      }
      float vf[EPL];
      for (int j = 0; j < VPL; ++j) {
        if (KV_BITS == 0) {
          uint4 raw = uint4(0);
          if (valid) {
            raw = *(const device uint4*)(v_pool + row + (r + j * LPT) * VEC);
          }
          pa_unpack(raw, vf + j * VEC, T(0));
        } else {
          pa_dequant(v_pool + row + (r + j * LPT) * VEC_CODES, valid, v_scale[j], v_bias[j], vf + j * VEC);
        }
      }
      for (int h = 0; h < GQA; ++h) {
        // Tokens past the context leave the state as it is (their V is never read).
        const float m_new = valid ? max(m[h], s[h]) : m[h];
        const float correction = fast::exp2(m[h] - m_new);
        const float p = valid ? fast::exp2(s[h] - m_new) : 0.0f;
        l[h] = l[h] * correction + p;
        for (int i = 0; i < EPL; ++i) {
          acc[h * EPL + i] = acc[h * EPL + i] * correction + p * vf[i];
        }
        m[h] = m_new;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // Merge token groups lying KEEP or more groups apart in the simdgroup by shuffles
  // (only when threadgroup memory cannot hold every group), then all groups here.
  for (int o = LPT * KEEP; o < 32; o *= 2) {
    for (int h = 0; h < GQA; ++h) {
      const float m_other = simd_shuffle_xor(m[h], ushort(o));
      const float l_other = simd_shuffle_xor(l[h], ushort(o));
      const float m_new = max(m[h], m_other);
      const float w_self = fast::exp2(m[h] - m_new);
      const float w_other = fast::exp2(m_other - m_new);
      l[h] = l[h] * w_self + l_other * w_other;
      for (int i = 0; i < EPL; ++i) {
        const float a_other = simd_shuffle_xor(acc[h * EPL + i], ushort(o));
        acc[h * EPL + i] = acc[h * EPL + i] * w_self + a_other * w_other;
      }
      m[h] = m_new;
    }
  }
  const int group = sg * KEEP + tok_group;
  for (int h = 0; h < GQA; ++h) {
    if (tok_group < KEEP) {
      if (r == 0) {
        group_max[group] = m[h];
        group_sum[group] = l[h];
      }
      for (int j = 0; j < VPL; ++j) {
        for (int e = 0; e < VEC; ++e) {
          group_acc[group * HEAD_DIM + (r + j * LPT) * VEC + e] = acc[h * EPL + j * VEC + e];
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float m_all = -FLT_MAX;
    for (int g = 0; g < GROUPS; ++g) {
      m_all = max(m_all, group_max[g]);
    }
    float l_all = 0.0f;
    for (int g = 0; g < GROUPS; ++g) {
      l_all += group_sum[g] * fast::exp2(group_max[g] - m_all);
    }
    // The sink joins the one-pass denominator here (split-K: in the reduce kernel).
    float o_scale = 1.0f;
    if (SINKS == 1 && PARTITION_SIZE == 0) {
      const float sink = sinks[head_group * GQA + h];
      const float m_sink = max(m_all, sink);
      o_scale = fast::exp2(m_all - m_sink);
      l_all = l_all * o_scale + fast::exp2(sink - m_sink);
    }
    // An empty context (or a partition past it) gives 0, not 0/0.
    const float inv_l = l_all > 0.0f ? o_scale / l_all : 0.0f;
    const int64_t out_row = q_row + h;
    for (int d = tid; d < HEAD_DIM; d += TG) {
      float o = 0.0f;
      for (int g = 0; g < GROUPS; ++g) {
        o += fast::exp2(group_max[g] - m_all) * group_acc[g * HEAD_DIM + d];
      }
      if (PARTITION_SIZE == 0) {
        out[out_row * HEAD_DIM + d] = static_cast<OutT>(o * inv_l);
      } else {
        out[(out_row * num_partitions + part) * HEAD_DIM + d] = static_cast<OutT>(o * inv_l);
      }
    }
    if (PARTITION_SIZE > 0 && tid == 0) {
      max_logits[out_row * num_partitions + part] = m_all;
      exp_sums[out_row * num_partitions + part] = l_all;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
