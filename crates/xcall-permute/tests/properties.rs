//! Properties of the argument checks, over random (mostly wrong) input:
//! nothing panics, and what the checks accept is safe to run: every output
//! row of `permute` is written from exactly one route or zeroed, as a
//! reference written here from the raw map says.

use proptest::prelude::*;
use xcall_core::DType;
use xcall_permute::ops::{permute, PermuteInputs, PermuteOutputs};
use xcall_permute::{make_row_id_map, RowIdMapOptions, RowIdMapRef};

/// Maps the full check accepted: the property is not vacuous.
static ACCEPTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A fixed case budget, so CI time does not depend on luck.
fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Values near the edges of every range the checks guard, and small ones.
fn edgy() -> impl Strategy<Value = i64> {
    prop_oneof![
        -3i64..12,
        Just(i64::MAX),
        Just(i64::MIN),
        Just(i32::MAX as i64),
        Just(1i64 << 62),
    ]
}

proptest! {
    #![proptest_config(config())]

    /// A valid row-id map with one entry of the map, the counts or the
    /// offsets changed (or none): refused, or every output row is written by
    /// one route or zeroed, as the raw map says.
    #[test]
    fn accepted_maps_write_every_row_once(
        tokens in 0usize..6,
        experts in 1usize..4,
        routing in prop::collection::vec(0u8..2, 0..24),
        spare in 0usize..3,
        target in 0usize..3,
        at in 0usize..64,
        value in edgy(),
    ) {
        let mut routing = routing;
        routing.resize(tokens * experts, 0);
        let made = make_row_id_map(&routing, tokens, experts, RowIdMapOptions::default()).unwrap();
        let out_rows = made.out_rows + spare;
        let (mut map, mut tpe, mut offsets) = (made.map, made.tokens_per_expert, made.expert_offsets);
        match target {
            0 if !map.is_empty() => { let i = at % map.len(); map[i] = value as i32; }
            1 => { let i = at % tpe.len(); tpe[i] = value; }
            _ => { let i = at % offsets.len(); offsets[i] = value; }
        }
        let width = 2 * experts + 1;
        let h = 2;
        let input: Vec<u8> = (0..tokens * h * 4).map(|i| (i % 251) as u8 + 1).collect();
        let mut output = vec![0xeeu8; out_rows * h * 4];
        let Ok(view) = RowIdMapRef::new(tokens, experts, &map, &tpe, &offsets, out_rows) else {
            return Ok(());
        };
        ACCEPTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        permute(
            view,
            &PermuteInputs { input: &input, dtype: DType::F32, hidden: h, probs: None, scales: None },
            &mut PermuteOutputs { output: &mut output, permuted_probs: None, permuted_scales: None },
        )
        .unwrap();
        // Reference: which token each row comes from, from the raw map.
        let mut from: Vec<Option<usize>> = vec![None; out_rows];
        for t in 0..tokens {
            let row = &map[t * width..(t + 1) * width];
            for &dst in &row[..row[2 * experts] as usize] {
                let dst = dst as usize;
                prop_assert!(from[dst].is_none(), "row {} written twice", dst);
                from[dst] = Some(t);
            }
        }
        let row_bytes = h * 4;
        for (r, src) in from.iter().enumerate() {
            let got = &output[r * row_bytes..(r + 1) * row_bytes];
            match src {
                Some(t) => prop_assert_eq!(got, &input[t * row_bytes..(t + 1) * row_bytes]),
                None => prop_assert!(got.iter().all(|&b| b == 0), "row {} not zeroed", r),
            }
        }
    }

    /// Any options over a random routing: an error, or a map whose rows
    /// fit the i32 map and whose destinations lie below out_rows.
    #[test]
    fn row_id_map_options_never_wrap(
        tokens in 0usize..6,
        experts in 1usize..5,
        routing in prop::collection::vec(0u8..3, 0..30),
        cap in prop::option::of(prop_oneof![0usize..20, Just(usize::MAX), Just(1usize << 40)]),
        align in prop::option::of(prop_oneof![0usize..9, Just(usize::MAX), Just(1usize << 62), Just(1usize << 31)]),
        capacity in prop::option::of(prop_oneof![0usize..9, Just(usize::MAX), Just(1usize << 62), Just(1usize << 31)]),
    ) {
        let mut routing = routing;
        routing.resize(tokens * experts, 0);
        let options = RowIdMapOptions { num_out_tokens: cap, align, capacity, groups: None };
        if let Ok(m) = make_row_id_map(&routing, tokens, experts, options) {
            prop_assert!(m.out_rows <= i32::MAX as usize);
            prop_assert!(m.expert_offsets.windows(2).all(|w| w[0] <= w[1]));
            for t in 0..tokens {
                for (dst, e) in m.routes(t) {
                    prop_assert!(dst < m.out_rows && e < experts);
                }
            }
            // What make_row_id_map gives, the full check accepts.
            prop_assert!(RowIdMapRef::new(tokens, experts, &m.map, &m.tokens_per_expert, &m.expert_offsets, m.out_rows).is_ok());
        }
    }
}

#[test]
fn the_map_property_saw_accepted_maps() {
    // Runs the property itself so the count does not depend on test order.
    accepted_maps_write_every_row_once();
    let n = ACCEPTED.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        n >= 50,
        "only {n} of 512 maps were accepted: the property tests little"
    );
}
