// paged_prefill_attention_mma: causal attention of new query rows over the paged K/V,
// on the matrix units (simdgroup_matrix 8x8 tiles), the GQA query heads of one KV head
// per threadgroup.
//
// File layout: see paged_attention_decode.metal (documentation, then
// "// --- header ---", then "// --- body ---").
//
// Algorithm: FlashAttention-2 (Dao 2023) over the paged layout, with 8x8 tiles as in
// MLX's steel attention: per step of 8 keys, S = Q K^T (HEAD_DIM / 8 multiply-
// accumulates), online softmax per row in base 2 (q pre-scaled by scale * log2(e)),
// O = diag(correction) O + P V. Query row j of a sequence with q_len new tokens and
// context context_len sits at position context_len - q_len + j and attends to keys
// 0..position, or with a sliding window to keys position - window + 1 .. position (the
// step loop then starts at the step holding the first row's first key). With sinks
// (gpt-oss) each row's sink logit joins its denominator at the end. A finite -FLT_MAX
// sentinel; key slots outside [first row's window start, last position] are staged as 0.
//
// Launch (built by mlx_ferrum/kernels/metal.py):
//   grid        = (num_tiles * NUM_SIMD * 32, num_kv_heads, 1) threads
//   threadgroup = (NUM_SIMD * 32, 1, 1): one group per (tile of <= 8 query rows of one
//                 sequence, KV head); simdgroup w serves query heads w, w + NUM_SIMD, ...
//                 of the KV head's GQA heads.
// Inputs:
//   q            [num_tokens, num_kv_heads * GQA, HEAD_DIM] T
//   k_pool       [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM] T
//   v_pool       same as k_pool
//   block_tables [num_seqs * max_blocks_per_seq] int32, padded to >= 8 elements
//   tiles        [num_tiles * 4] int32: seq, first_row, rows (1..8), first_position
//   params       [8] int32: num_heads, num_kv_heads, max_blocks_per_seq, window
//                (sliding window in tokens; 0 = none)
//   scale        0-d float32: softmax scale times log2(e)
//   sinks        [max(8, num_heads)] float32: sink logits times log2(e) (read only when
//                SINKS == 1)
// Output:
//   out          [num_tokens, num_heads, HEAD_DIM] T
// Template: T, HEAD_DIM (multiple of 8), BLOCK_SIZE (multiple of 8), GQA, NUM_SIMD,
//   HEADS_PER_SIMD (= ceil(GQA / NUM_SIMD)), SINKS (0 or 1).
// Threadgroup memory: K and V of 8 keys as float (2 * 8 * HEAD_DIM * 4 bytes) and, per
//   simdgroup, two 8x8 float tiles (scores / probabilities, the diagonal scaling):
//   16 KiB + 2 KiB at HEAD_DIM 256.
// --- header ---
// --- body ---
  constexpr int TG = NUM_SIMD * 32;
  constexpr int DC = HEAD_DIM / 8;

  threadgroup float k_tile[8 * HEAD_DIM];
  threadgroup float v_tile[8 * HEAD_DIM];
  threadgroup float s_tile[NUM_SIMD * 64];
  threadgroup float d_tile[NUM_SIMD * 64];

  const int num_heads = params[0];
  const int num_kv_heads = params[1];
  const int max_blocks = params[2];
  const int window = params[3];
  const int tile = threadgroup_position_in_grid.x;
  const int kv_head = threadgroup_position_in_grid.y;
  const int tid = thread_index_in_threadgroup;
  const int sg = simdgroup_index_in_threadgroup;
  const int lane = thread_index_in_simdgroup;
  const int seq = tiles[4 * tile];
  const int first_row = tiles[4 * tile + 1];
  const int rows = tiles[4 * tile + 2];
  const int first_pos = tiles[4 * tile + 3];
  const int num_keys = first_pos + rows;  // causal: the last row sees keys 0..first_pos + rows - 1
  const int num_steps = (num_keys + 7) / 8;
  const int first_key = window > 0 ? max(0, first_pos - window + 1) : 0;
  threadgroup float* s_mine = s_tile + sg * 64;
  threadgroup float* d_mine = d_tile + sg * 64;

  // Q tiles, pre-scaled, zero in rows past the tile; lane r < 8 owns row r's statistics.
  simdgroup_float8x8 qm[HEADS_PER_SIMD * DC];
  simdgroup_float8x8 om[HEADS_PER_SIMD * DC];
  float m[HEADS_PER_SIMD];
  float l[HEADS_PER_SIMD];
  for (int hh = 0; hh < HEADS_PER_SIMD; ++hh) {
    const int h = sg + hh * NUM_SIMD;
    const int64_t q_head = int64_t(kv_head) * GQA + min(h, GQA - 1);
    for (int c = 0; c < DC; ++c) {
      for (int i = lane; i < 64; i += 32) {
        const int r = i / 8;
        const int d = c * 8 + i % 8;
        s_mine[i] = r < rows && h < GQA
            ? float(q[(int64_t(first_row + r) * num_heads + q_head) * HEAD_DIM + d]) * scale : 0.0f;
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
      simdgroup_load(qm[hh * DC + c], s_mine, 8);
      simdgroup_barrier(mem_flags::mem_threadgroup);
      om[hh * DC + c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    m[hh] = -FLT_MAX;
    l[hh] = 0.0f;
  }

  const int64_t head_stride = int64_t(BLOCK_SIZE) * HEAD_DIM;
  const int64_t block_stride = head_stride * num_kv_heads;
  for (int step = first_key / 8; step < num_steps; ++step) {
    const int k0 = step * 8;
    // 8 keys never straddle a block (BLOCK_SIZE is a multiple of 8).
    const int physical_block = block_tables[int64_t(seq) * max_blocks + k0 / BLOCK_SIZE];
    const int64_t base = physical_block * block_stride + int64_t(kv_head) * head_stride
        + int64_t(k0 % BLOCK_SIZE) * HEAD_DIM;
    for (int i = tid; i < 8 * HEAD_DIM; i += TG) {
      const bool valid = k0 + i / HEAD_DIM < num_keys && k0 + i / HEAD_DIM >= first_key;
      k_tile[i] = valid ? float(k_pool[base + i]) : 0.0f;
      v_tile[i] = valid ? float(v_pool[base + i]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int hh = 0; hh < HEADS_PER_SIMD; ++hh) {
      simdgroup_float8x8 s = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int c = 0; c < DC; ++c) {
        simdgroup_float8x8 kt;
        const ulong2 at = {ulong(c * 8), 0};
        simdgroup_load(kt, k_tile, HEAD_DIM, at, true);
        simdgroup_multiply_accumulate(s, qm[hh * DC + c], kt, s);
      }
      simdgroup_store(s, s_mine, 8);
      simdgroup_barrier(mem_flags::mem_threadgroup);
      if (lane < 8) {
        const int pos = first_pos + lane;
        const int row_first_key = window > 0 ? pos - window + 1 : 0;
        float row_max = -FLT_MAX;
        for (int j = 0; j < 8; ++j) {
          const bool valid = lane < rows && k0 + j >= row_first_key && k0 + j <= pos;
          row_max = valid ? max(row_max, s_mine[lane * 8 + j]) : row_max;
        }
        const float m_new = max(m[hh], row_max);
        const float correction = fast::exp2(m[hh] - m_new);
        float row_sum = 0.0f;
        for (int j = 0; j < 8; ++j) {
          const bool valid = lane < rows && k0 + j >= row_first_key && k0 + j <= pos;
          const float p = valid ? fast::exp2(s_mine[lane * 8 + j] - m_new) : 0.0f;
          s_mine[lane * 8 + j] = p;
          d_mine[lane * 8 + j] = j == lane ? correction : 0.0f;
          row_sum += p;
        }
        l[hh] = l[hh] * correction + row_sum;
        m[hh] = m_new;
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
      simdgroup_float8x8 p;
      simdgroup_float8x8 scaling;
      simdgroup_load(p, s_mine, 8);
      simdgroup_load(scaling, d_mine, 8);
      for (int c = 0; c < DC; ++c) {
        simdgroup_float8x8 v;
        const ulong2 at = {ulong(c * 8), 0};
        simdgroup_load(v, v_tile, HEAD_DIM, at, false);
        simdgroup_multiply(om[hh * DC + c], scaling, om[hh * DC + c]);
        simdgroup_multiply_accumulate(om[hh * DC + c], p, v, om[hh * DC + c]);
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (int hh = 0; hh < HEADS_PER_SIMD; ++hh) {
    const int h = sg + hh * NUM_SIMD;
    if (lane < 8) {
      for (int j = 0; j < 8; ++j) {
        float o_scale = 1.0f;
        float l_all = l[hh];
        if (SINKS == 1) {
          const float sink = sinks[int64_t(kv_head) * GQA + min(h, GQA - 1)];
          const float m_sink = max(m[hh], sink);
          o_scale = fast::exp2(m[hh] - m_sink);
          l_all = l_all * o_scale + fast::exp2(sink - m_sink);
        }
        d_mine[lane * 8 + j] = j == lane && l[hh] > 0.0f ? o_scale / l_all : 0.0f;
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 inv_l;
    simdgroup_load(inv_l, d_mine, 8);
    for (int c = 0; c < DC; ++c) {
      simdgroup_float8x8 o;
      simdgroup_multiply(o, inv_l, om[hh * DC + c]);
      simdgroup_store(o, s_mine, 8);
      simdgroup_barrier(mem_flags::mem_threadgroup);
      for (int i = lane; i < 64; i += 32) {
        const int r = i / 8;
        if (r < rows && h < GQA) {
          out[(int64_t(first_row + r) * num_heads + int64_t(kv_head) * GQA + h) * HEAD_DIM + c * 8 + i % 8] =
              static_cast<T>(s_mine[i]);
        }
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
