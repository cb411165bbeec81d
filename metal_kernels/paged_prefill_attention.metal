// paged_prefill_attention: causal attention of several new tokens per sequence
// over the sequence's cached prefix in the pool plus themselves.
//
// File layout: see paged_attention_decode.metal (documentation, then
// "// --- header ---", then "// --- body ---").
//
// Algorithm: FlashAttention-style tiling (Dao et al., 2022) over vLLM's paged
// layout (Kwon et al., SOSP 2023): a threadgroup takes up to NUM_SIMD consecutive
// query rows of one sequence and one head (one row per simdgroup), stages
// KV_TILE tokens of K and V at a time in threadgroup memory (as float), and each
// simdgroup updates its row's online softmax (float32 max, sum and output).
// Query row j of a sequence with q_len new tokens and context_len tokens sits at
// position context_len - q_len + j and attends to keys 0..position, or with a
// sliding window (Mistral; gpt-oss's even layers) to keys position - window + 1 ..
// position: the tile loop then starts at the tile holding the first row's first key,
// so earlier blocks are never read. With sinks (gpt-oss) the head's sink logit joins
// the softmax denominator at the end: out = acc e^(m - M) / (l e^(m - M) + e^(sink - M)),
// M = max(m, sink).
//
// Launch (built by mlx_ferrum/kernels/metal.py):
//   grid        = (num_tiles * NUM_SIMD * 32, num_heads, 1) threads
//   threadgroup = (NUM_SIMD * 32, 1, 1): one group per (tile of rows, head)
// Inputs:
//   q            [num_tokens, num_heads, HEAD_DIM] T (packed rows of all sequences)
//   k_pool       [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM] T, or quantized codes
//                (KV_BITS 8: int8, same shape; KV_BITS 4: uint8 [..., HEAD_DIM / 2])
//   v_pool       same as k_pool
//   block_tables [num_seqs * max_blocks_per_seq] int32, padded to >= 8 elements
//   tiles        [num_tiles * 4] int32, padded to >= 8 elements: per tile the
//                sequence, its first q row, its row count (<= NUM_SIMD) and the
//                position of its first row; a tile never spans two sequences
//   params       [8] int32: num_heads, num_kv_heads, max_blocks_per_seq, window
//                (sliding window in tokens; 0 = none)
//   scale        0-d float32
//   sinks        [max(8, num_heads)] float32 attention-sink logits (read only when
//                SINKS == 1)
//   k_scales, v_scales, k_biases, v_biases: as in paged_attention_decode (float16 group
//                scales and int4 biases beside quantized pools; [8] placeholders, unread,
//                for float pools)
// Output:
//   out          [num_tokens, num_heads, HEAD_DIM] T
// Template: T, HEAD_DIM (multiple of 8, <= 256), BLOCK_SIZE, NUM_SIMD, KV_TILE
//   (tokens staged per step: a power of two dividing BLOCK_SIZE, with
//   2 * KV_TILE * HEAD_DIM * 4 bytes of threadgroup memory), SINKS (0 or 1),
//   KV_BITS and GROUP_SIZE (as in paged_attention_decode).
// Quantized pools: the staging step dequantizes. A thread takes one scale group of one
// token (GROUP_SIZE codes, read as 8-code vectors, and its scale and bias, each read once)
// and writes the group's floats to the tile; int4 keys are stored rotated and q arrives
// rotated (see paged_attention_decode).
// --- header ---
// Lanes that share one token's dot product: the largest power of two <= 32 that
// divides head_dim (see paged_attention_decode.metal).
constexpr int pa_lanes_per_token(int head_dim) {
  int lanes = 32;
  while (lanes > 1 && head_dim % lanes != 0) {
    lanes /= 2;
  }
  return lanes;
}
// 8 quantized codes at p into out[0..8) as code * s + b (see paged_attention_decode;
// the fp overload is never called but compiles).
template <typename C>
METAL_FUNC void pa_stage_dequant(const device C*, float, float, threadgroup float* out) {
  for (int i = 0; i < 8; ++i) {
    out[i] = 0.0f;
  }
}
METAL_FUNC void pa_stage_dequant(const device int8_t* p, float s, float, threadgroup float* out) {
  const uint2 raw = *(const device uint2*)p;
  for (int w = 0; w < 2; ++w) {
    const char4 c = as_type<char4>(raw[w]);
    for (int i = 0; i < 4; ++i) {
      out[4 * w + i] = float(c[i]) * s;
    }
  }
}
METAL_FUNC void pa_stage_dequant(const device uint8_t* p, float s, float b, threadgroup float* out) {
  const uint raw = *(const device uint*)p;
  for (int e = 0; e < 8; ++e) {
    out[e] = float((raw >> (4 * e)) & 0xFu) * s + b;
  }
}
// --- body ---
  constexpr int ROW = KV_BITS == 4 ? HEAD_DIM / 2 : HEAD_DIM;
  constexpr int NG = HEAD_DIM / GROUP_SIZE;
  constexpr int LPT = pa_lanes_per_token(HEAD_DIM);
  constexpr int TPS = 32 / LPT;
  constexpr int EPL = HEAD_DIM / LPT;
  constexpr int TG = NUM_SIMD * 32;

  threadgroup float k_tile[KV_TILE * HEAD_DIM];
  threadgroup float v_tile[KV_TILE * HEAD_DIM];

  const int tile = threadgroup_position_in_grid.x;
  const int head = threadgroup_position_in_grid.y;
  const int num_heads = params[0];
  const int num_kv_heads = params[1];
  const int max_blocks = params[2];
  const int window = params[3];
  const int seq = tiles[4 * tile];
  const int row0 = tiles[4 * tile + 1];
  const int num_rows = tiles[4 * tile + 2];
  const int pos0 = tiles[4 * tile + 3];
  const int kv_head = head / (num_heads / num_kv_heads);
  const int lane = thread_index_in_simdgroup;
  const int sg = simdgroup_index_in_threadgroup;
  const int tid = thread_index_in_threadgroup;
  const int tok_group = lane / LPT;
  const int r = lane % LPT;

  // Idle simdgroups (a short last tile) still stage K/V and meet every barrier.
  const bool active = sg < num_rows;
  const int pos = pos0 + sg;
  const int last_pos = pos0 + num_rows - 1;
  // First key of this row's window, and of the tile's first row (where loading starts).
  const int row_first_key = window > 0 ? pos - window + 1 : 0;
  const int first_key = window > 0 ? max(0, pos0 - window + 1) : 0;
  const int64_t out_row = (int64_t(row0) + sg) * num_heads + head;

  float qv[EPL];
  float acc[EPL];
  for (int i = 0; i < EPL; ++i) {
    qv[i] = active ? float(q[out_row * HEAD_DIM + r + i * LPT]) * scale : 0.0f;
    acc[i] = 0.0f;
  }
  // A finite sentinel and a loop bound computed up front: no infinity, no
  // data-dependent exit, so fast math cannot change the result.
  float m = -FLT_MAX;
  float l = 0.0f;

  const int64_t head_stride = int64_t(BLOCK_SIZE) * ROW;
  const int64_t block_stride = head_stride * num_kv_heads;
  const int64_t scale_head_stride = int64_t(BLOCK_SIZE) * NG;
  const int64_t scale_block_stride = scale_head_stride * num_kv_heads;
  for (int k0 = first_key / KV_TILE * KV_TILE; k0 <= last_pos; k0 += KV_TILE) {
    const int physical_block = block_tables[int64_t(seq) * max_blocks + k0 / BLOCK_SIZE];
    const int64_t base = physical_block * block_stride + kv_head * head_stride + (k0 % BLOCK_SIZE) * ROW;
    if (KV_BITS == 0) {
      for (int e = tid; e < KV_TILE * HEAD_DIM; e += TG) {
        // Slots past the last needed key may hold garbage (even NaN): stage zeros.
        const bool needed = k0 + e / HEAD_DIM <= last_pos && k0 + e / HEAD_DIM >= first_key;
        k_tile[e] = needed ? float(k_pool[base + e]) : 0.0f;
        v_tile[e] = needed ? float(v_pool[base + e]) : 0.0f;
      }
    } else {
      const int64_t scale_base = physical_block * scale_block_stride + kv_head * scale_head_stride
          + (k0 % BLOCK_SIZE) * NG;
      for (int item = tid; item < KV_TILE * NG; item += TG) {
        const int t = item / NG;
        const int group = item % NG;
        const bool needed = k0 + t <= last_pos && k0 + t >= first_key;
        const int64_t at = scale_base + t * NG + group;
        const float k_scale = needed ? float(k_scales[at]) : 0.0f;
        const float v_scale = needed ? float(v_scales[at]) : 0.0f;
        const float k_bias = needed && KV_BITS == 4 ? float(k_biases[at]) : 0.0f;
        const float v_bias = needed && KV_BITS == 4 ? float(v_biases[at]) : 0.0f;
        const int64_t codes = base + int64_t(t) * ROW + group * GROUP_SIZE * ROW / HEAD_DIM;
        threadgroup float* k_out = k_tile + t * HEAD_DIM + group * GROUP_SIZE;
        threadgroup float* v_out = v_tile + t * HEAD_DIM + group * GROUP_SIZE;
        for (int v8 = 0; v8 < GROUP_SIZE / 8; ++v8) {
          if (needed) {
            pa_stage_dequant(k_pool + codes + v8 * 8 * ROW / HEAD_DIM, k_scale, k_bias, k_out + v8 * 8);
            pa_stage_dequant(v_pool + codes + v8 * 8 * ROW / HEAD_DIM, v_scale, v_bias, v_out + v8 * 8);
          } else {
            for (int i = 0; i < 8; ++i) {
              k_out[v8 * 8 + i] = 0.0f;
              v_out[v8 * 8 + i] = 0.0f;
            }
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    if (active) {
      // Keys k0 .. pos of this tile: every step below has at least one valid key.
      const int keys_here = min(KV_TILE, pos - k0 + 1);
      for (int t0 = 0; t0 < keys_here; t0 += TPS) {
        const int t = t0 + tok_group;
        const bool valid = t < KV_TILE && k0 + t >= row_first_key && k0 + t <= pos;
        float s = 0.0f;
        if (valid) {
          for (int i = 0; i < EPL; ++i) {
            s += qv[i] * k_tile[t * HEAD_DIM + r + i * LPT];
          }
        }
        for (int o = LPT / 2; o > 0; o /= 2) {
          s += simd_shuffle_xor(s, ushort(o));
        }
        s = valid ? s : -FLT_MAX;
        const float step_max = simd_max(s);
        const float m_new = max(m, step_max);
        const float correction = exp(m - m_new);
        const float p = valid ? exp(s - m_new) : 0.0f;
        l = l * correction + simd_sum(r == 0 ? p : 0.0f);
        for (int i = 0; i < EPL; ++i) {
          const float v = valid ? float(v_tile[t * HEAD_DIM + r + i * LPT]) : 0.0f;
          acc[i] = acc[i] * correction + p * v;
        }
        m = m_new;
      }
    }
    // The next tile overwrites k_tile/v_tile: every row must be done with this one.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (active) {
    for (int o = LPT; o < 32; o *= 2) {
      for (int i = 0; i < EPL; ++i) {
        acc[i] += simd_shuffle_xor(acc[i], ushort(o));
      }
    }
    float o_scale = 1.0f;
    if (SINKS == 1) {
      const float sink = sinks[head];
      const float m_sink = max(m, sink);
      o_scale = exp(m - m_sink);
      l = l * o_scale + exp(sink - m_sink);
    }
    if (tok_group == 0) {
      for (int i = 0; i < EPL; ++i) {
        out[out_row * HEAD_DIM + r + i * LPT] = static_cast<T>(acc[i] * o_scale / l);
      }
    }
  }
