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
    fn byte_counts_are_64_bit_and_checked() {
        assert_eq!(DType::Bf16.bytes_for(1 << 33).unwrap(), 1 << 34);
        assert!(DType::F32.bytes_for(u64::MAX / 2).is_err());
    }
}
