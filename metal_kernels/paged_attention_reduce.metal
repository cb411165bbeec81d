// paged_attention_reduce: merge the per-partition results of paged_attention_decode.
//
// File layout: see paged_attention_decode.metal (documentation, then
// "// --- header ---", then "// --- body ---").
//
// Algorithm: the reduce step of vLLM's paged attention v2 (Kwon et al., SOSP
// 2023): with m_p and l_p the max logit (log2 units) and exp-sum of partition p and
// o_p its normalised output, out = sum_p w_p o_p / sum_p w_p where
// w_p = l_p exp2(m_p - M) and M = max_p m_p. Only the partitions a sequence's
// context and window reach are read; a row with no token (context 0) is 0. With
// sinks (gpt-oss), M also covers the head's sink logit, and exp2(sink - M) joins the
// denominator (the sink has no value).
//
// Launch (built by mlx_ferrum/kernels/metal.py):
//   grid        = (HEAD_DIM, num_heads, num_seqs) threads
//   threadgroup = (HEAD_DIM, 1, 1): one thread per output element
// Inputs:
//   tmp_out      [num_seqs, num_heads, NUM_PARTITIONS, HEAD_DIM] float
//   max_logits   [num_seqs, num_heads, NUM_PARTITIONS] float
//   exp_sums     [num_seqs, num_heads, NUM_PARTITIONS] float
//   context_lens [num_seqs] int32, padded to >= 8 elements
//   params       [8] int32: num_heads, num_partitions, partition_size, window
//                (0 = none)
//   sinks        [max(8, num_heads)] float32: sink logits times log2(e) (read only
//                when SINKS == 1)
// Output:
//   out          [num_seqs, num_heads, HEAD_DIM] T
// Template: T, HEAD_DIM, NUM_PARTITIONS, SINKS (0 or 1).
// Threadgroup memory: 8 * NUM_PARTITIONS bytes (the partitions' statistics, read from
// device memory once per threadgroup).
// --- header ---
// --- body ---
  threadgroup float part_max[NUM_PARTITIONS];
  threadgroup float part_sum[NUM_PARTITIONS];

  const int d = thread_position_in_grid.x;
  const int head = thread_position_in_grid.y;
  const int seq = thread_position_in_grid.z;
  const int num_heads = params[0];
  const int partition_size = params[2];
  const int window = params[3];
  const int ctx = context_lens[seq];
  const int used = min(NUM_PARTITIONS, (ctx + partition_size - 1) / partition_size);
  // Partitions wholly before the window hold nothing: they are not read.
  const int first = window > 0 ? min(used, max(0, ctx - window) / partition_size) : 0;
  const int64_t row = int64_t(seq) * num_heads + head;

  // Each partition's statistics are read from device memory once, then shared.
  for (int p = d; p < NUM_PARTITIONS; p += HEAD_DIM) {
    const bool read = p >= first && p < used;
    part_max[p] = read ? max_logits[row * NUM_PARTITIONS + p] : -FLT_MAX;
    part_sum[p] = read ? exp_sums[row * NUM_PARTITIONS + p] : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float m_all = -FLT_MAX;
  for (int p = first; p < used; ++p) {
    m_all = max(m_all, part_max[p]);
  }
  float sink = -FLT_MAX;
  if (SINKS == 1) {
    sink = sinks[head];
    m_all = max(m_all, sink);
  }
  float l_all = SINKS == 1 ? fast::exp2(sink - m_all) : 0.0f;
  float o = 0.0f;
  for (int p = first; p < used; ++p) {
    const float w = part_sum[p] * fast::exp2(part_max[p] - m_all);
    l_all += w;
    o += w * tmp_out[(row * NUM_PARTITIONS + p) * HEAD_DIM + d];
  }
  out[row * HEAD_DIM + d] = static_cast<T>(l_all > 0.0f ? o / l_all : 0.0f);
