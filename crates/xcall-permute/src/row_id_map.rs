// Over 600 lines: the map's layout, its Host builder and the checks every consumer of a map runs, which must agree.
//! Routing map to row-id map, with token caps and expert padding.
//!
//! Layout (as TransformerEngine's): `row_id_map` is `[T, 2E + 1]` of i32.
//! For token `t` with `n` routes, columns `[0, n)` hold the destination
//! rows, columns `[E, E + n)` their experts, and column `2E` holds `n`;
//! unused columns are -1. Destinations are expert-major with tokens
//! ascending within an expert: `dst = offset[e] + rank of t among the
//! tokens routed to e`. A route's columns are in ascending expert order.

use xcall_core::alloc::try_vec;

use crate::error::{shape, PermuteError};

/// `2E + 1`, checked.
fn map_width(experts: usize) -> Result<usize, PermuteError> {
    if experts > i32::MAX as usize {
        return Err(shape(format!(
            "{experts} experts: expert ids do not fit the i32 row-id map"
        )));
    }
    experts
        .checked_mul(2)
        .and_then(|w| w.checked_add(1))
        .ok_or_else(|| shape(format!("{experts} experts overflow the row-id map width")))
}

/// Map faults the CUDA kernels found (bits; see `xcall_permute_fault` in
/// the C header). A kernel that follows a map skips an entry pointing
/// outside its tensors and records the first three kinds; checked mode
/// ([`crate::call::Target::checked`]) finds the rest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapFaults(pub u32);

/// cbindgen:ignore
impl MapFaults {
    /// A token's route count is outside `[0, E]`.
    pub const ROUTE_COUNT: u32 = 1;
    /// A route's expert is outside `[0, E)`.
    pub const EXPERT: u32 = 2;
    /// A route's destination row is outside `[0, N)`.
    pub const ROW: u32 = 4;
    /// A route's row is outside its expert's kept rows (checked mode).
    pub const CHUNK_ROW: u32 = 8;
    /// Two routes write one row (checked mode).
    pub const DUPLICATE_ROW: u32 = 16;
    /// An expert chunk is invalid or `tokens_per_expert` differs from the
    /// routes the map sends to it (checked mode).
    pub const COUNTS: u32 = 32;
    /// A chunk-sort map entry is outside `[0, T)`.
    pub const SORT_MAP: u32 = 64;
    /// Every bit.
    pub const ALL: u32 = 127;

    const NAMES: [(u32, &'static str); 7] = [
        (Self::ROUTE_COUNT, "a route count outside [0, E]"),
        (Self::EXPERT, "a route's expert outside [0, E)"),
        (Self::ROW, "a route's row outside [0, N)"),
        (Self::CHUNK_ROW, "a route outside its expert's kept rows"),
        (Self::DUPLICATE_ROW, "two routes to one row"),
        (
            Self::COUNTS,
            "tokens_per_expert or expert_offsets disagreeing with the map",
        ),
        (Self::SORT_MAP, "a chunk-sort map entry outside [0, T)"),
    ];

    /// Whether no fault was found.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl std::fmt::Display for MapFaults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0 == 0 {
            return f.write_str("no fault");
        }
        let names: Vec<&str> = Self::NAMES
            .iter()
            .filter(|(bit, _)| self.0 & bit != 0)
            .map(|(_, name)| *name)
            .collect();
        f.write_str(&names.join("; "))?;
        if self.0 & !Self::ALL != 0 {
            write!(f, "; unknown bits {:#x}", self.0 & !Self::ALL)?;
        }
        Ok(())
    }
}

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
    /// Expert groups with fixed bases: see [`ExpertGroups`]. Combinable
    /// with `align`, not with `num_out_tokens` or `capacity`.
    pub groups: Option<ExpertGroups>,
}

/// Consecutive experts in groups whose chunks start at fixed rows, e.g.
/// one group per destination of an expert-parallel exchange: group `g`
/// (experts `[g * experts, (g + 1) * experts)`) owns the rows
/// `[g * rows, (g + 1) * rows)` and packs its experts' chunks densely from
/// its first row, in expert order (each padded to `align` when given).
/// The layout's group bases do not depend on the routing (`E / experts *
/// rows` output rows in all), while within a group no row is spent on an
/// expert's unused capacity. A route whose row would reach its group's
/// end is dropped (the tail of the group's expert-major order); with
/// `rows >= T * min(k, experts)` (plus `experts * (align - 1)` when
/// padded) nothing is dropped when every token has at most `k` routes.
/// The rows of a group past its last chunk's kept routes are padding of
/// its last expert (zeroed by `permute`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertGroups {
    /// Experts per group: at least 1, a divisor of `E`.
    pub experts: usize,
    /// Rows per group: at least 1.
    pub rows: usize,
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
    /// `[0, E)`, expert chunks well formed (`0 <= offsets[e]`,
    /// `offsets[e] + tokens_per_expert[e] <= offsets[e + 1]`), every route
    /// of expert `e` inside its kept rows `[offsets[e], offsets[e] +
    /// tokens_per_expert[e])`, `tokens_per_expert[e]` routes to expert `e`,
    /// and no two routes sharing a destination row. Together these say the
    /// ops that write rows write each kept row exactly once and zero the
    /// rest. `O(T * E + out_rows)` time, `out_rows` bits of memory.
    pub fn new(
        tokens: usize,
        experts: usize,
        map: &'a [i32],
        tokens_per_expert: &'a [i64],
        expert_offsets: &'a [i64],
        out_rows: usize,
    ) -> Result<Self, PermuteError> {
        let view = Self::routes_only(tokens, experts, map, out_rows)?;
        if tokens_per_expert.len() != experts || expert_offsets.len() != experts.saturating_add(1) {
            return Err(shape(format!(
                "tokens_per_expert and expert_offsets need {experts} and {} entries, have {} and {}",
                experts + 1,
                tokens_per_expert.len(),
                expert_offsets.len()
            )));
        }
        for e in 0..experts {
            let (start, end, kept) = (
                expert_offsets[e],
                expert_offsets[e + 1],
                tokens_per_expert[e],
            );
            let kept_end = start.checked_add(kept);
            if start < 0 || kept < 0 || kept_end.is_none_or(|k| k > end) {
                return Err(shape(format!(
                    "expert {e}: offsets [{start}, {end}) with {kept} tokens is not a valid chunk"
                )));
            }
        }
        let mut routed = try_vec(experts, 0i64, "routes per expert")?;
        let mut taken = try_vec(out_rows, false, "destination rows")?;
        for t in 0..tokens {
            for (dst, e) in view.routes(t) {
                let (start, kept) = (expert_offsets[e], tokens_per_expert[e]);
                if (dst as i64) < start || dst as i64 >= start + kept {
                    return Err(shape(format!(
                        "row_id_map token {t} sends expert {e}'s route to row {dst}, outside its kept rows [{start}, {})",
                        start + kept
                    )));
                }
                if std::mem::replace(&mut taken[dst], true) {
                    return Err(shape(format!(
                        "row_id_map token {t} writes row {dst}, which an earlier route writes too: every destination row must be unique"
                    )));
                }
                routed[e] += 1;
            }
        }
        if let Some(e) = (0..experts).find(|&e| routed[e] != tokens_per_expert[e]) {
            return Err(shape(format!(
                "tokens_per_expert[{e}] is {}, but the row-id map routes {} token(s) to expert {e}",
                tokens_per_expert[e], routed[e]
            )));
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
        let width = map_width(experts)?;
        if tokens.checked_mul(width) != Some(map.len()) {
            return Err(shape(format!(
                "row_id_map has {} entries, [{tokens}, {width}] needs more or fewer",
                map.len(),
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
    if let Some(g) = options.groups {
        if g.experts == 0 || g.rows == 0 {
            return Err(shape(format!(
                "expert groups of {} experts and {} rows: both must be at least 1",
                g.experts, g.rows
            )));
        }
        if options.capacity.is_some() || options.num_out_tokens.is_some() {
            return Err(shape(
                "expert groups cannot be combined with num_out_tokens or capacity: they fix every group's rows",
            ));
        }
    }
    Ok(())
}

/// Refuses options whose layout for `tokens` x `experts` could need rows
/// past the i32 row-id map, whatever the routing: checked before any work
/// on both platforms, so a huge `align` or `capacity` is an error, never a
/// wrapped offset (the CUDA kernels compute offsets without a way to fail).
pub fn check_layout(
    options: RowIdMapOptions,
    tokens: usize,
    experts: usize,
) -> Result<(), PermuteError> {
    check_options(options)?;
    let rows_max = i32::MAX as u128;
    if let Some(g) = options.groups {
        if experts % g.experts != 0 {
            return Err(shape(format!(
                "{experts} experts do not split into groups of {}",
                g.experts
            )));
        }
        let rows = (experts / g.experts) as u128 * g.rows as u128;
        if rows > rows_max {
            return Err(shape(format!(
                "{} groups of {} rows need {rows} rows, past the i32 row-id map ({rows_max})",
                experts / g.experts,
                g.rows
            )));
        }
        return Ok(());
    }
    let chunk = match (options.capacity, options.align) {
        (Some(c), _) => c as u128,
        // The most an expert can hold: every token, padded.
        (None, Some(a)) => (tokens as u128).div_ceil(a as u128) * a as u128,
        (None, None) => tokens as u128,
    };
    let worst = chunk * experts as u128;
    if options.num_out_tokens.is_none() && worst > rows_max {
        let what = match (options.capacity, options.align) {
            (Some(c), _) => format!("capacity {c}"),
            (None, Some(a)) => format!("align {a}"),
            (None, None) => "no cap".to_string(),
        };
        return Err(shape(format!(
            "{experts} experts x {tokens} tokens with {what} may need {worst} rows, past the i32 row-id map ({rows_max}); lower it or set num_out_tokens"
        )));
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
    check_layout(options, tokens, experts)?;
    let width = map_width(experts)?;
    let mut counts = try_vec(experts, 0i64, "routes per expert")?;
    for t in 0..tokens {
        for e in 0..experts {
            counts[e] += (routing[t * experts + e] != 0) as i64;
        }
    }
    // Offsets are i64 (and rows i32, checked below): every step is checked
    // so a huge align or capacity is an error, never a wrapped offset.
    let too_many = |what: &str| {
        shape(format!(
            "{what}: the expert chunks need more rows than an i64 offset holds"
        ))
    };
    let align = i64::try_from(options.align.unwrap_or(1)).map_err(|_| too_many("align"))?;
    let mut offsets = try_vec(experts + 1, 0i64, "expert offsets")?;
    // The first row past each expert's group: where its routes stop
    // (checked to fit the i32 map above).
    let group_end = |e: usize| {
        options
            .groups
            .map_or(i64::MAX, |g| ((e / g.experts + 1) * g.rows) as i64)
    };
    let mut at = 0i64;
    for (e, &c) in counts.iter().enumerate() {
        if let Some(g) = options.groups.filter(|g| e % g.experts == 0) {
            at = ((e / g.experts) * g.rows) as i64;
        }
        at = at.min(group_end(e));
        offsets[e] = at;
        let chunk = match options.capacity {
            Some(capacity) => i64::try_from(capacity).ok(),
            None => (c / align + i64::from(c % align != 0)).checked_mul(align),
        };
        at = chunk
            .and_then(|chunk| at.checked_add(chunk))
            .ok_or_else(|| {
                too_many(if options.capacity.is_some() {
                    "capacity"
                } else {
                    "align"
                })
            })?;
    }
    offsets[experts] = match options.groups {
        Some(g) => ((experts / g.experts) * g.rows) as i64,
        None => at,
    };
    let out_rows = options.num_out_tokens.unwrap_or(offsets[experts] as usize);
    if out_rows > i32::MAX as usize {
        return Err(shape(format!(
            "{out_rows} output rows do not fit the i32 row-id map"
        )));
    }
    let cap = out_rows as i64;
    let entries = tokens
        .checked_mul(width)
        .ok_or_else(|| shape(format!("row_id_map [{tokens}, {width}] overflows a size")))?;
    let mut map = try_vec(entries, -1i32, "row_id_map")?;
    let mut rank = try_vec(experts, 0i64, "route ranks")?;
    let mut kept = try_vec(experts, 0i64, "kept routes")?;
    for t in 0..tokens {
        let row = &mut map[t * width..(t + 1) * width];
        let mut n = 0;
        for e in 0..experts {
            if routing[t * experts + e] == 0 {
                continue;
            }
            let dst = offsets[e] + rank[e];
            rank[e] += 1;
            if dst < cap
                && dst < group_end(e)
                && options.capacity.is_none_or(|c| rank[e] <= c as i64)
            {
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
    fn map_faults_name_every_bit_and_unknown_ones() {
        assert_eq!(MapFaults(0).to_string(), "no fault");
        assert!(MapFaults(0).is_empty() && !MapFaults(MapFaults::ROW).is_empty());
        assert_eq!(
            MapFaults(MapFaults::ROW | MapFaults::DUPLICATE_ROW).to_string(),
            "a route's row outside [0, N); two routes to one row"
        );
        let all = MapFaults(MapFaults::ALL).to_string();
        assert_eq!(all.split("; ").count(), 7, "{all}");
        assert_eq!(
            MapFaults(MapFaults::EXPERT | 0x300).to_string(),
            "a route's expert outside [0, E); unknown bits 0x300"
        );
        let bits = [
            MapFaults::ROUTE_COUNT,
            MapFaults::EXPERT,
            MapFaults::ROW,
            MapFaults::CHUNK_ROW,
            MapFaults::DUPLICATE_ROW,
            MapFaults::COUNTS,
            MapFaults::SORT_MAP,
        ];
        assert_eq!(bits.iter().fold(0, |a, b| a | b), MapFaults::ALL);
        assert!(bits.iter().all(|b| b.is_power_of_two()));
    }

    /// The bounds at their exact edges (known answers).
    #[test]
    fn layout_and_width_bounds_at_their_edges() {
        let max = i32::MAX as usize;
        assert_eq!(map_width(max).unwrap(), 2 * max + 1);
        assert!(map_width(max + 1).is_err());
        assert!(map_width(max + 2).is_err());
        let none = RowIdMapOptions::default();
        // Without options the worst case is every token on every expert.
        assert!(check_layout(none, max, 1).is_ok());
        assert!(check_layout(none, max + 1, 1).is_err());
        assert!(check_layout(none, max + 2, 1).is_err());
        assert!(check_layout(none, 1 << 40, 1).is_err());
        // align 4 pads 10 tokens to 12 rows per expert: 12 * 178956970 =
        // 2147483640 rows fit, one more expert does not.
        let align = RowIdMapOptions {
            align: Some(4),
            ..none
        };
        assert!(check_layout(align, 10, 178_956_970).is_ok());
        assert!(check_layout(align, 10, 178_956_971).is_err());
        // capacity fixes the chunk: capacity * experts rows.
        let capacity = RowIdMapOptions {
            capacity: Some(1 << 16),
            ..none
        };
        assert!(check_layout(capacity, 1, (1 << 15) - 1).is_ok());
        assert!(check_layout(capacity, 1, 1 << 15).is_err());
        // A cap on the output rows lifts the bound.
        let capped = RowIdMapOptions {
            num_out_tokens: Some(100),
            ..none
        };
        assert!(check_layout(capped, 1 << 40, 1).is_ok());
    }

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
                    groups: None,
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
