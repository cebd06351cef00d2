//! Element types.

use crate::{Error, Result};

/// Element type of a buffer (`xcall_dtype` in C). Codes are stable.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 binary32.
    F32 = 1,
    /// IEEE 754 binary16.
    F16 = 2,
    /// bfloat16 (8 exponent bits, 7 mantissa bits).
    Bf16 = 3,
    /// 8-bit float, 4 exponent bits, 3 mantissa bits, finite only (OCP E4M3FN).
    F8E4M3 = 4,
    /// 8-bit float, 5 exponent bits, 2 mantissa bits (OCP E5M2).
    F8E5M2 = 5,
    /// 32-bit signed integer.
    I32 = 6,
    /// 64-bit signed integer.
    I64 = 7,
    /// 8-bit unsigned integer.
    U8 = 8,
    /// Boolean stored in one byte (0 or 1).
    Bool = 9,
}

impl DType {
    /// Every dtype, in code order.
    ///
    /// cbindgen:ignore
    pub const ALL: [DType; 9] = [
        DType::F32,
        DType::F16,
        DType::Bf16,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::Bool,
    ];

    /// The dtype with this C code, if any.
    pub fn from_code(code: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| *d as u32 == code)
    }

    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::F8E4M3 | DType::F8E5M2 | DType::U8 | DType::Bool => 1,
            DType::I64 => 8,
        }
    }

    /// Whether the dtype is a floating-point format.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DType::F32 | DType::F16 | DType::Bf16 | DType::F8E4M3 | DType::F8E5M2
        )
    }

    /// Short lower-case name, as used by NumPy/JAX where one exists.
    pub fn name(self) -> &'static str {
        self.c_name().to_str().unwrap_or("unknown")
    }

    /// [`DType::name`], NUL-terminated.
    pub fn c_name(self) -> &'static std::ffi::CStr {
        match self {
            DType::F32 => c"f32",
            DType::F16 => c"f16",
            DType::Bf16 => c"bf16",
            DType::F8E4M3 => c"f8e4m3",
            DType::F8E5M2 => c"f8e5m2",
            DType::I32 => c"i32",
            DType::I64 => c"i64",
            DType::U8 => c"u8",
            DType::Bool => c"bool",
        }
    }

    /// Bytes taken by `elements` values, or an error when that overflows.
    pub fn bytes_for(self, elements: u64) -> Result<u64> {
        elements
            .checked_mul(self.size_bytes() as u64)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{elements} elements of {self} overflow a 64-bit byte count"
                ))
            })
    }
}

/// Reads and writes the elements of an f32, f16 or bf16 buffer (little
/// endian) as f32; stores round to nearest, ties to even. Made once per
/// call (that is where the dtype is checked), then used in the inner loops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FloatCodec(DType);

impl FloatCodec {
    /// The codec of `dtype`, or `None` unless it is f32, f16 or bf16.
    pub fn new(dtype: DType) -> Option<FloatCodec> {
        matches!(dtype, DType::F32 | DType::F16 | DType::Bf16).then_some(FloatCodec(dtype))
    }

    /// The dtype read and written.
    pub fn dtype(self) -> DType {
        self.0
    }

    /// Element `i` of `bytes` as f32.
    #[inline]
    pub fn load(self, bytes: &[u8], i: usize) -> f32 {
        match self.0 {
            DType::F32 => f32::from_le_bytes([
                bytes[4 * i],
                bytes[4 * i + 1],
                bytes[4 * i + 2],
                bytes[4 * i + 3],
            ]),
            DType::F16 => half::f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
            _ => half::bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        }
    }

    /// Writes `v` as element `i` of `bytes`.
    #[inline]
    pub fn store(self, bytes: &mut [u8], i: usize, v: f32) {
        match self.0 {
            DType::F32 => bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
            DType::F16 => {
                bytes[2 * i..2 * i + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes())
            }
            _ => bytes[2 * i..2 * i + 2].copy_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let lower = s.to_ascii_lowercase();
        let alias = match lower.as_str() {
            "float32" => "f32",
            "float16" | "half" => "f16",
            "bfloat16" => "bf16",
            "float8_e4m3fn" | "f8e4m3fn" => "f8e4m3",
            "float8_e5m2" => "f8e5m2",
            "int32" => "i32",
            "int64" => "i64",
            "uint8" => "u8",
            other => other,
        };
        DType::ALL
            .into_iter()
            .find(|d| d.name() == alias)
            .ok_or_else(|| Error::InvalidArgument(format!("unknown dtype {s:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_the_rust_types() {
        assert_eq!(DType::F32.size_bytes(), std::mem::size_of::<f32>());
        assert_eq!(DType::I32.size_bytes(), std::mem::size_of::<i32>());
        assert_eq!(DType::I64.size_bytes(), std::mem::size_of::<i64>());
        assert_eq!(DType::U8.size_bytes(), std::mem::size_of::<u8>());
        assert_eq!(DType::Bool.size_bytes(), std::mem::size_of::<bool>());
        assert_eq!(DType::F16.size_bytes(), 2);
        assert_eq!(DType::Bf16.size_bytes(), 2);
        assert_eq!(DType::F8E4M3.size_bytes(), 1);
        assert_eq!(DType::F8E5M2.size_bytes(), 1);
    }

    #[test]
    fn names_round_trip_and_codes_are_stable() {
        let published = [
            (1, "f32"),
            (2, "f16"),
            (3, "bf16"),
            (4, "f8e4m3"),
            (5, "f8e5m2"),
            (6, "i32"),
            (7, "i64"),
            (8, "u8"),
            (9, "bool"),
        ];
        for (code, name) in published {
            let d = DType::from_code(code).unwrap();
            assert_eq!(d.name(), name);
            assert_eq!(name.parse::<DType>().unwrap(), d);
        }
        assert_eq!(DType::from_code(0), None);
        assert_eq!("bfloat16".parse::<DType>().unwrap(), DType::Bf16);
        assert!("f128".parse::<DType>().is_err());
    }

    #[test]
    fn float_codec_known_answers() {
        assert!(FloatCodec::new(DType::I32).is_none());
        assert!(FloatCodec::new(DType::F8E4M3).is_none());
        let mut b = [0u8; 8];
        let bf = FloatCodec::new(DType::Bf16).unwrap();
        // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even.
        bf.store(&mut b, 0, f32::from_bits(0x3F80_8000));
        assert_eq!(u16::from_le_bytes([b[0], b[1]]), 0x3F80);
        // 1.01171875 is halfway between 0x3F81 and 0x3F82: ties to even (0x3F82).
        bf.store(&mut b, 1, f32::from_bits(0x3F81_8000));
        assert_eq!(u16::from_le_bytes([b[2], b[3]]), 0x3F82);
        assert_eq!(bf.load(&b, 1), 1.015625);
        let h = FloatCodec::new(DType::F16).unwrap();
        h.store(&mut b, 0, 1.0);
        assert_eq!(u16::from_le_bytes([b[0], b[1]]), 0x3C00);
        assert_eq!(h.load(&b, 0), 1.0);
        let f = FloatCodec::new(DType::F32).unwrap();
        f.store(&mut b, 1, -2.5);
        assert_eq!(&b[4..8], &(-2.5f32).to_le_bytes());
        assert_eq!(f.load(&b, 1), -2.5);
    }

    #[test]
    fn byte_counts_are_64_bit_and_checked() {
        assert_eq!(DType::Bf16.bytes_for(1 << 33).unwrap(), 1 << 34);
        assert!(DType::F32.bytes_for(u64::MAX / 2).is_err());
    }
}
