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
//   tmp_out      [num_seqs, num_heads, num_partitions, HEAD_DIM] float
//   max_logits   [num_seqs, num_heads, num_partitions] float
//   exp_sums     [num_seqs, num_heads, num_partitions] float
//   context_lens [num_seqs] int32, padded to >= 8 elements
//   params       [8] int32: num_heads, num_partitions, partition_size
// Output:
//   out          [num_seqs, num_heads, HEAD_DIM] T
// Template: T, HEAD_DIM.
// --- header ---
// --- body ---
  const int d = thread_position_in_grid.x;
  const int head = thread_position_in_grid.y;
  const int seq = thread_position_in_grid.z;
  const int num_heads = params[0];
  const int num_partitions = params[1];
  const int partition_size = params[2];
  const int used = min(num_partitions, (context_lens[seq] + partition_size - 1) / partition_size);
  const int64_t row = int64_t(seq) * num_heads + head;

  float m_all = -FLT_MAX;
  for (int p = 0; p < used; ++p) {
    m_all = max(m_all, float(max_logits[row * num_partitions + p]));
  }
  float l_all = 0.0f;
  float o = 0.0f;
  for (int p = 0; p < used; ++p) {
    const float w = exp_sums[row * num_partitions + p] * fast::exp2(max_logits[row * num_partitions + p] - m_all);
    l_all += w;
    o += w * tmp_out[(row * num_partitions + p) * HEAD_DIM + d];
  }
  out[row * HEAD_DIM + d] = static_cast<T>(l_all > 0.0f ? o / l_all : 0.0f);
