//! Element encoding shared by the op tests.

#![allow(dead_code)] // each test file takes what it needs

use half::bf16;
use xcall_core::DType;

/// `v` as little-endian f32 or bf16 (round to nearest even) bytes.
pub fn encode(dtype: DType, v: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        _ => v
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
            .collect(),
    }
}

/// The f32 values of little-endian f32 or bf16 bytes.
pub fn decode(dtype: DType, b: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => b
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        _ => b
            .chunks(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    }
}

/// `n` values in [-4, 4) (products and silu arguments of every magnitude
/// class) encoded as `dtype`.
pub fn random_bytes(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
    let v: Vec<f32> = xcall_core::testing::random_f32(n, seed)
        .into_iter()
        .map(|x| x * 4.0)
        .collect();
    encode(dtype, &v)
}
