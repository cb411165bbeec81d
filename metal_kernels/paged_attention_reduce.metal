// paged_attention_reduce: merge the per-partition results of paged_attention_decode.
//
// File layout: see paged_attention_decode.metal (documentation, then
// "// --- header ---", then "// --- body ---").
//
// Algorithm: the reduce step of vLLM's paged attention v2 (Kwon et al., SOSP
// 2023): with m_p and l_p the max logit (log2 units) and exp-sum of partition p and
// o_p its normalised output, out = sum_p w_p o_p / sum_p w_p where
// w_p = l_p exp2(m_p - M) and M = max_p m_p. Only the partitions a sequence's
// context reaches are read; a row with no token (context 0) is 0.
//
// Launch (built by mlx_ferrum/kernels/metal.py):
//   grid        = (HEAD_DIM, num_heads, num_seqs) threads
//   threadgroup = (HEAD_DIM, 1, 1): one thread per output element
// Inputs:
//   tmp_out      [num_seqs, num_heads, NUM_PARTITIONS, HEAD_DIM] float
//   max_logits   [num_seqs, num_heads, NUM_PARTITIONS] float
//   exp_sums     [num_seqs, num_heads, NUM_PARTITIONS] float
//   context_lens [num_seqs] int32, padded to >= 8 elements
//   params       [8] int32: num_heads, num_partitions, partition_size
// Output:
//   out          [num_seqs, num_heads, HEAD_DIM] T
// Template: T, HEAD_DIM, NUM_PARTITIONS.
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
  const int used = min(NUM_PARTITIONS, (context_lens[seq] + partition_size - 1) / partition_size);
  const int64_t row = int64_t(seq) * num_heads + head;

  // Each partition's statistics are read from device memory once, then shared.
  for (int p = d; p < NUM_PARTITIONS; p += HEAD_DIM) {
    part_max[p] = p < used ? max_logits[row * NUM_PARTITIONS + p] : -FLT_MAX;
    part_sum[p] = p < used ? exp_sums[row * NUM_PARTITIONS + p] : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float m_all = -FLT_MAX;
  for (int p = 0; p < used; ++p) {
    m_all = max(m_all, part_max[p]);
  }
  float l_all = 0.0f;
  float o = 0.0f;
  for (int p = 0; p < used; ++p) {
    const float w = part_sum[p] * fast::exp2(part_max[p] - m_all);
    l_all += w;
    o += w * tmp_out[(row * NUM_PARTITIONS + p) * HEAD_DIM + d];
  }
  out[row * HEAD_DIM + d] = static_cast<T>(l_all > 0.0f ? o / l_all : 0.0f);
