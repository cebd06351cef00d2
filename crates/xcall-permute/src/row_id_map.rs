//! Routing map to row-id map, with token caps and expert padding.
//!
//! Layout (as TransformerEngine's): `row_id_map` is `[T, 2E + 1]` of i32.
//! For token `t` with `n` routes, columns `[0, n)` hold the destination
//! rows, columns `[E, E + n)` their experts, and column `2E` holds `n`;
//! unused columns are -1. Destinations are expert-major with tokens
//! ascending within an expert: `dst = offset[e] + rank of t among the
//! tokens routed to e`. A route's columns are in ascending expert order.

use crate::error::{shape, PermuteError};

/// Options of [`make_row_id_map`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowIdMapOptions {
    /// Output rows; routes whose destination row is at or past it are
    /// dropped (deterministically: the tail of the expert-major order).
    pub num_out_tokens: Option<usize>,
    /// Pads every expert's chunk to a multiple of this many rows (padded
    /// rows are zeroed by `permute`). Not combinable with a cap.
    pub align: Option<usize>,
}

/// A row-id map and the facts derived with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowIdMap {
    /// Tokens `T`.
    pub tokens: usize,
    /// Experts `E`.
    pub experts: usize,
    /// `[T, 2E + 1]`, see the module docs.
    pub map: Vec<i32>,
    /// Routes kept per expert (before padding).
    pub tokens_per_expert: Vec<i64>,
    /// First output row of each expert's chunk, then the end of the last
    /// chunk (`E + 1` values; padded when `align` was given).
    pub expert_offsets: Vec<i64>,
    /// Rows of the permuted output.
    pub out_rows: usize,
}

impl RowIdMap {
    /// Row width of `map`: `2E + 1`.
    pub fn width(&self) -> usize {
        2 * self.experts + 1
    }

    /// The output rows no route writes, as ranges: each expert chunk's rows
    /// past its kept routes (its padding), and the rows past the last chunk
    /// (when `num_out_tokens` exceeds the routes). Ops zero exactly these.
    pub fn unwritten_rows(&self) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        let rows = self.out_rows;
        let clamp = move |x: i64| (x.max(0) as usize).min(rows);
        let chunks = (0..self.experts).map(move |e| {
            clamp(self.expert_offsets[e] + self.tokens_per_expert[e])
                ..clamp(self.expert_offsets[e + 1])
        });
        chunks
            .chain(std::iter::once(
                clamp(self.expert_offsets[self.experts])..rows,
            ))
            .filter(|r| !r.is_empty())
    }

    /// The kept routes of token `t` as (destination row, expert), in
    /// ascending expert order.
    pub fn routes(&self, t: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let row = &self.map[t * self.width()..(t + 1) * self.width()];
        let n = row[2 * self.experts] as usize;
        (0..n).map(move |k| (row[k] as usize, row[self.experts + k] as usize))
    }
}

/// Builds the row-id map of `routing` (`[tokens, experts]`, each 0 or 1).
pub fn make_row_id_map(
    routing: &[u8],
    tokens: usize,
    experts: usize,
    options: RowIdMapOptions,
) -> Result<RowIdMap, PermuteError> {
    if experts == 0 {
        return Err(shape("a routing map needs at least 1 expert"));
    }
    let cells = tokens
        .checked_mul(experts)
        .ok_or_else(|| shape("tokens x experts overflows"))?;
    if routing.len() != cells {
        return Err(shape(format!(
            "routing map has {} entries, [{tokens}, {experts}] needs {cells}",
            routing.len()
        )));
    }
    if let Some(i) = routing.iter().position(|&v| v > 1) {
        return Err(shape(format!(
            "routing map entry [{}, {}] is {}, not 0 or 1",
            i / experts,
            i % experts,
            routing[i]
        )));
    }
    if options.align == Some(0) {
        return Err(shape("align must be at least 1"));
    }
    if options.align.is_some() && options.num_out_tokens.is_some() {
        return Err(shape(
            "num_out_tokens and align cannot be combined: padding fixes the output size",
        ));
    }
    let mut counts = vec![0i64; experts];
    for t in 0..tokens {
        for e in 0..experts {
            counts[e] += routing[t * experts + e] as i64;
        }
    }
    let align = options.align.unwrap_or(1) as i64;
    let mut offsets = Vec::with_capacity(experts + 1);
    let mut at = 0i64;
    for &c in &counts {
        offsets.push(at);
        at += (c + align - 1) / align * align;
    }
    offsets.push(at);
    let out_rows = options.num_out_tokens.unwrap_or(at as usize);
    if out_rows > i32::MAX as usize {
        return Err(shape(format!(
            "{out_rows} output rows do not fit the i32 row-id map"
        )));
    }
    let cap = out_rows as i64;
    let width = 2 * experts + 1;
    let mut map = vec![-1i32; tokens * width];
    let mut rank = vec![0i64; experts];
    let mut kept = vec![0i64; experts];
    for t in 0..tokens {
        let row = &mut map[t * width..(t + 1) * width];
        let mut n = 0;
        for e in 0..experts {
            if routing[t * experts + e] == 0 {
                continue;
            }
            let dst = offsets[e] + rank[e];
            rank[e] += 1;
            if dst < cap {
                row[n] = dst as i32;
                row[experts + n] = e as i32;
                n += 1;
                kept[e] += 1;
            }
        }
        row[2 * experts] = n as i32;
    }
    Ok(RowIdMap {
        tokens,
        experts,
        map,
        tokens_per_expert: kept,
        expert_offsets: offsets,
        out_rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unwritten_rows_are_exactly_the_rows_no_route_writes() {
        let mut seed = 7u64;
        for (tokens, experts, cap, align) in [
            (50, 6, None, None),
            (50, 6, Some(31), None),
            (50, 6, Some(200), None),
            (50, 6, Some(0), None),
            (50, 6, None, Some(4)),
            (0, 3, None, Some(8)),
        ] {
            let routing: Vec<u8> = (0..tokens * experts)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    (seed % 3 == 0) as u8
                })
                .collect();
            let map = make_row_id_map(
                &routing,
                tokens,
                experts,
                RowIdMapOptions {
                    num_out_tokens: cap,
                    align,
                },
            )
            .unwrap();
            let mut written = vec![false; map.out_rows];
            for t in 0..tokens {
                for (dst, _) in map.routes(t) {
                    written[dst] = true;
                }
            }
            let mut unwritten = vec![false; map.out_rows];
            for r in map.unwritten_rows() {
                unwritten[r].fill(true);
            }
            let expected: Vec<bool> = written.iter().map(|w| !w).collect();
            assert_eq!(
                unwritten, expected,
                "T={tokens} E={experts} cap={cap:?} align={align:?}"
            );
        }
    }
}
