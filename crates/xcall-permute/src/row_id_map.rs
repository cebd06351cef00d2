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
    /// Expert capacity: every expert's chunk is exactly this many rows
    /// (expert `e` starts at row `e * capacity`, `E * capacity` rows in
    /// all), so the layout does not depend on the routing. An expert's
    /// routes past its capacity are dropped (the later tokens); rows left
    /// free are padding (zeroed by `permute`). Not combinable with
    /// `num_out_tokens` or `align`.
    pub capacity: Option<usize>,
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

    /// A borrowed view, as the ops take it.
    pub fn view(&self) -> RowIdMapRef<'_> {
        RowIdMapRef {
            tokens: self.tokens,
            experts: self.experts,
            map: &self.map,
            chunks: Some((&self.tokens_per_expert, &self.expert_offsets)),
            out_rows: self.out_rows,
        }
    }

    /// See [`RowIdMapRef::unwritten_rows`].
    pub fn unwritten_rows(&self) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        self.view().unwritten_rows()
    }

    /// See [`RowIdMapRef::routes`].
    pub fn routes(&self, t: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.view().routes(t)
    }
}

/// A row-id map borrowed from elsewhere (for example memory a C caller
/// owns), checked once on construction so the ops can trust every entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowIdMapRef<'a> {
    tokens: usize,
    experts: usize,
    map: &'a [i32],
    /// (tokens_per_expert, expert_offsets), when known.
    chunks: Option<(&'a [i64], &'a [i64])>,
    out_rows: usize,
}

impl<'a> RowIdMapRef<'a> {
    /// Checks a map made elsewhere against `out_rows` output rows: lengths,
    /// route counts, destinations inside `[0, out_rows)` and experts inside
    /// `[0, E)`, expert chunks well formed. `O(T * E)`.
    pub fn new(
        tokens: usize,
        experts: usize,
        map: &'a [i32],
        tokens_per_expert: &'a [i64],
        expert_offsets: &'a [i64],
        out_rows: usize,
    ) -> Result<Self, PermuteError> {
        let view = Self::routes_only(tokens, experts, map, out_rows)?;
        if tokens_per_expert.len() != experts || expert_offsets.len() != experts + 1 {
            return Err(shape(format!(
                "tokens_per_expert and expert_offsets need {experts} and {} entries, have {} and {}",
                experts + 1,
                tokens_per_expert.len(),
                expert_offsets.len()
            )));
        }
        for e in 0..experts {
            let (start, end) = (expert_offsets[e], expert_offsets[e + 1]);
            if start < 0 || end < start || tokens_per_expert[e] < 0 {
                return Err(shape(format!(
                    "expert {e}: offsets [{start}, {end}) with {} tokens is not a valid chunk",
                    tokens_per_expert[e]
                )));
            }
        }
        Ok(RowIdMapRef {
            chunks: Some((tokens_per_expert, expert_offsets)),
            ..view
        })
    }

    /// Like [`RowIdMapRef::new`] without the expert chunks: enough for ops
    /// that only follow routes (`unpermute`), not for ops that zero the
    /// rows no route writes.
    pub fn routes_only(
        tokens: usize,
        experts: usize,
        map: &'a [i32],
        out_rows: usize,
    ) -> Result<Self, PermuteError> {
        if experts == 0 {
            return Err(shape("a row-id map needs at least 1 expert"));
        }
        let width = 2 * experts + 1;
        if map.len() != tokens * width {
            return Err(shape(format!(
                "row_id_map has {} entries, [{tokens}, {width}] needs {}",
                map.len(),
                tokens * width
            )));
        }
        for t in 0..tokens {
            let row = &map[t * width..(t + 1) * width];
            let n = row[2 * experts];
            if n < 0 || n as usize > experts {
                return Err(shape(format!(
                    "row_id_map token {t} has {n} routes, outside [0, {experts}]"
                )));
            }
            for k in 0..n as usize {
                let (dst, e) = (row[k], row[experts + k]);
                if dst < 0 || dst as usize >= out_rows || e < 0 || e as usize >= experts {
                    return Err(shape(format!(
                        "row_id_map token {t} route {k} is (row {dst}, expert {e}), outside [0, {out_rows}) x [0, {experts})"
                    )));
                }
            }
        }
        Ok(RowIdMapRef {
            tokens,
            experts,
            map,
            chunks: None,
            out_rows,
        })
    }

    /// Whether the expert chunks are known (see [`RowIdMapRef::new`]).
    pub fn has_chunks(&self) -> bool {
        self.chunks.is_some()
    }

    /// Tokens `T`.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Experts `E`.
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Rows of the permuted output.
    pub fn out_rows(&self) -> usize {
        self.out_rows
    }

    /// Row width of the map: `2E + 1`.
    pub fn width(&self) -> usize {
        2 * self.experts + 1
    }

    /// The output rows no route writes, as ranges: each expert chunk's rows
    /// past its kept routes (its padding), and the rows past the last chunk
    /// (when `num_out_tokens` exceeds the routes). Ops zero exactly these.
    /// Empty without the expert chunks ([`RowIdMapRef::routes_only`]).
    pub fn unwritten_rows(&self) -> impl Iterator<Item = std::ops::Range<usize>> + 'a {
        let rows = self.out_rows;
        let experts = self.experts;
        let (tpe, offsets): (&[i64], &[i64]) = self.chunks.unwrap_or((&[], &[]));
        let clamp = move |x: i64| (x.max(0) as usize).min(rows);
        let chunks = (0..tpe.len()).map(move |e| clamp(offsets[e] + tpe[e])..clamp(offsets[e + 1]));
        let tail = offsets.get(experts).map(|&end| clamp(end)..rows);
        chunks.chain(tail).filter(|r| !r.is_empty())
    }

    /// The kept routes of token `t` as (destination row, expert), in
    /// ascending expert order.
    pub fn routes(&self, t: usize) -> impl Iterator<Item = (usize, usize)> + 'a {
        let experts = self.experts;
        let row = &self.map[t * self.width()..(t + 1) * self.width()];
        let n = row[2 * experts] as usize;
        (0..n).map(move |k| (row[k] as usize, row[experts + k] as usize))
    }
}

/// Refuses options that cannot be honoured.
pub fn check_options(options: RowIdMapOptions) -> Result<(), PermuteError> {
    if options.align == Some(0) {
        return Err(shape("align must be at least 1"));
    }
    if options.align.is_some() && options.num_out_tokens.is_some() {
        return Err(shape(
            "num_out_tokens and align cannot be combined: padding fixes the output size",
        ));
    }
    if options
        .num_out_tokens
        .is_some_and(|n| n > i32::MAX as usize)
    {
        return Err(shape("num_out_tokens does not fit the i32 row-id map"));
    }
    if let Some(c) = options.capacity {
        if c == 0 {
            return Err(shape("capacity must be at least 1"));
        }
        if options.align.is_some() || options.num_out_tokens.is_some() {
            return Err(shape(
                "capacity cannot be combined with num_out_tokens or align: it fixes every chunk",
            ));
        }
    }
    Ok(())
}

/// Builds the row-id map of `routing` (`[tokens, experts]` bytes; any
/// nonzero byte is a route, as a bool mask stored in bytes reads).
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
    check_options(options)?;
    let mut counts = vec![0i64; experts];
    for t in 0..tokens {
        for e in 0..experts {
            counts[e] += (routing[t * experts + e] != 0) as i64;
        }
    }
    let align = options.align.unwrap_or(1) as i64;
    let mut offsets = Vec::with_capacity(experts + 1);
    let mut at = 0i64;
    for &c in &counts {
        offsets.push(at);
        at = match options.capacity {
            Some(capacity) => at.saturating_add(capacity as i64),
            None => at + (c + align - 1) / align * align,
        };
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
            if dst < cap && options.capacity.is_none_or(|c| rank[e] <= c as i64) {
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
                    capacity: None,
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
