//! Chunk sort: reorder `S` chunks of rows by a permutation of chunk indices.
//!
//! `make_chunk_sort_map(split_sizes, sorted_indices, T)` gives, for every
//! row `t`, its destination: the rows of input chunk `c` move to the output
//! position where `c` appears in `sorted_indices`, after the chunks listed
//! before it; rows at or past `sum(split_sizes)` map to themselves.
//! `sort_chunks_by_map` scatters (`out[map[t]] = in[t]`, forward) or
//! gathers (`out[t] = in[map[t]]`, backward), with optional per-row probs.

use xcall_core::alloc::try_vec;

use crate::alias::{self, Op, Region};
use crate::error::{shape, PermuteError};

/// The destination row of every row; see the module docs.
pub fn make_chunk_sort_map(
    split_sizes: &[i64],
    sorted_indices: &[i64],
    tokens: usize,
) -> Result<Vec<i64>, PermuteError> {
    check_split(split_sizes, sorted_indices, tokens)?;
    let chunks = split_sizes.len();
    // Where each input chunk starts in the input and in the output.
    let mut in_start = try_vec(chunks, 0i64, "chunk starts")?;
    for c in 1..chunks {
        in_start[c] = in_start[c - 1] + split_sizes[c - 1];
    }
    let mut out_start = try_vec(chunks, 0i64, "chunk destinations")?;
    let mut at = 0i64;
    for &c in sorted_indices {
        out_start[c as usize] = at;
        at += split_sizes[c as usize];
    }
    // check_split bounded the sizes' sum by `tokens`: no sum below wraps.
    let mut map = try_vec(tokens, 0i64, "chunk sort map")?;
    for (t, m) in map.iter_mut().enumerate() {
        *m = t as i64;
    }
    for c in 0..chunks {
        for k in 0..split_sizes[c] {
            map[(in_start[c] + k) as usize] = out_start[c] + k;
        }
    }
    Ok(map)
}

/// Refuses a split whose sizes are negative or sum past `tokens`, or
/// whose `sorted_indices` is not a permutation of the chunks.
pub fn check_split(
    split_sizes: &[i64],
    sorted_indices: &[i64],
    tokens: usize,
) -> Result<(), PermuteError> {
    let chunks = split_sizes.len();
    if sorted_indices.len() != chunks {
        return Err(shape(format!(
            "sorted_indices has {} entries for {chunks} chunks",
            sorted_indices.len()
        )));
    }
    if let Some(i) = split_sizes.iter().position(|&s| s < 0) {
        return Err(shape(format!(
            "split_sizes[{i}] is negative ({})",
            split_sizes[i]
        )));
    }
    // Checked: sizes summing past u64 are past any row count too.
    match split_sizes
        .iter()
        .try_fold(0u64, |acc, &s| acc.checked_add(s as u64))
    {
        Some(total) if total <= tokens as u64 => {}
        Some(total) => {
            return Err(shape(format!(
                "split_sizes sum to {total}, past the {tokens} rows"
            )))
        }
        None => {
            return Err(shape(format!(
                "split_sizes sum past 2^64, past the {tokens} rows"
            )))
        }
    }
    let mut seen = try_vec(chunks, false, "chunks seen")?;
    for (i, &c) in sorted_indices.iter().enumerate() {
        if c < 0 || c as usize >= chunks || seen[c as usize] {
            return Err(shape(format!(
                "sorted_indices is not a permutation of 0..{chunks} (entry {i} is {c})"
            )));
        }
        seen[c as usize] = true;
    }
    Ok(())
}

/// Direction of [`sort_chunks_by_map`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// `out[map[t]] = in[t]`.
    Forward,
    /// `out[t] = in[map[t]]` (the inverse of forward).
    Backward,
}

/// Reorders the rows of `input` (`[T, row_bytes]`) by `map`, and the
/// optional per-row `probs` the same way. Outputs must not overlap inputs.
pub fn sort_chunks_by_map(
    input: &[u8],
    row_bytes: usize,
    map: &[i64],
    probs: Option<&[f32]>,
    direction: Direction,
    output: &mut [u8],
    permuted_probs: Option<&mut [f32]>,
) -> Result<(), PermuteError> {
    let tokens = map.len();
    if tokens.checked_mul(row_bytes) != Some(input.len()) || output.len() != input.len() {
        return Err(shape(format!(
            "input and output must hold {tokens} rows of {row_bytes} bytes ({} and {} bytes given)",
            input.len(),
            output.len()
        )));
    }
    let mut hit = try_vec(tokens, false, "rows hit")?;
    for (t, &d) in map.iter().enumerate() {
        if d < 0 || d as usize >= tokens || std::mem::replace(&mut hit[d as usize], true) {
            return Err(shape(format!(
                "map is not a permutation of 0..{tokens} (entry {t} is {d})"
            )));
        }
    }
    match (&probs, &permuted_probs) {
        (Some(p), Some(pp)) if p.len() != tokens || pp.len() != tokens => {
            return Err(shape(format!(
                "probs and permuted_probs must have {tokens} entries"
            )));
        }
        (Some(_), None) | (None, Some(_)) => {
            return Err(shape("probs and permuted_probs come together"))
        }
        _ => {}
    }
    let mut ins = vec![Region::of("input", input)];
    ins.extend(probs.map(|p| Region::of("probs", p)));
    let mut outs = vec![Region::of("output", output)];
    outs.extend(
        permuted_probs
            .as_deref()
            .map(|p| Region::of("permuted_probs", p)),
    );
    alias::check(&ins, &outs, alias::alias_table(Op::SortChunksByMap))?;
    let mut permuted_probs = permuted_probs;
    for (t, &d) in map.iter().enumerate() {
        let (src, dst) = match direction {
            Direction::Forward => (t, d as usize),
            Direction::Backward => (d as usize, t),
        };
        output[dst * row_bytes..(dst + 1) * row_bytes]
            .copy_from_slice(&input[src * row_bytes..(src + 1) * row_bytes]);
        if let (Some(p), Some(pp)) = (probs, permuted_probs.as_deref_mut()) {
            pp[dst] = p[src];
        }
    }
    Ok(())
}
