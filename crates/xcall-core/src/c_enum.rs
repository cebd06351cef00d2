//! C enums decoded one way. A C caller passes an enum as a `uint32_t`
//! (any value, since C does not check); Rust must never hold a value its
//! enum does not define, so every code is decoded through [`CEnum`], which
//! [`c_enum!`](crate::c_enum) implements for a `#[repr(u32)]` enum from the
//! list of its variants (the list is checked to be exhaustive at compile
//! time).

/// A `#[repr(u32)]` enum the C ABI passes as a code.
pub trait CEnum: Copy + Sized + 'static {
    /// What a code of this enum is called in an error message ("dtype code",
    /// "platform code", ...).
    const NOUN: &'static str;
    /// Every value, in declaration order.
    const VALUES: &'static [Self];

    /// The code.
    fn code(self) -> u32;

    /// The value with this code, if any.
    fn decode(code: u32) -> Option<Self> {
        Self::VALUES.iter().copied().find(|v| v.code() == code)
    }

    /// "unknown <noun> <code> (valid: ...)" for a code that is not one.
    fn unknown(code: u32) -> String {
        let valid: Vec<String> = Self::VALUES.iter().map(|v| v.code().to_string()).collect();
        format!(
            "unknown {} {code} (valid: {})",
            Self::NOUN,
            valid.join(", ")
        )
    }
}

/// Implements [`CEnum`](crate::CEnum) for a `#[repr(u32)]` enum, and gives
/// it `ALL` (every value, in declaration order) and `from_code`. Every
/// variant must be listed: a missing one fails the build.
///
/// ```
/// #[repr(u32)]
/// #[derive(Clone, Copy, Debug, PartialEq)]
/// enum Side { Left = 0, Right = 7 }
/// xcall_core::c_enum!(Side, "side", [Left, Right]);
/// use xcall_core::CEnum;
/// assert_eq!(Side::from_code(7), Some(Side::Right));
/// assert_eq!(Side::from_code(1), None);
/// assert_eq!(Side::unknown(1), "unknown side 1 (valid: 0, 7)");
/// ```
///
/// ```compile_fail
/// #[repr(u32)]
/// #[derive(Clone, Copy, Debug, PartialEq)]
/// enum Side { Left = 0, Right = 7 }
/// xcall_core::c_enum!(Side, "side", [Left]);
/// ```
#[macro_export]
macro_rules! c_enum {
    ($name:ident, $noun:literal, [$($variant:ident),+ $(,)?]) => {
        impl $name {
            /// Every value, in declaration order.
            pub const ALL: [$name; [$(stringify!($variant)),+].len()] = [$($name::$variant),+];

            /// The value with this C code, if any.
            pub fn from_code(code: u32) -> ::std::option::Option<$name> {
                <$name as $crate::CEnum>::decode(code)
            }
        }

        impl $crate::CEnum for $name {
            const NOUN: &'static str = $noun;
            const VALUES: &'static [$name] = &$name::ALL;

            fn code(self) -> u32 {
                self as u32
            }
        }

        const _: () = {
            // Every variant listed: a new variant fails this match.
            #[allow(dead_code)]
            fn exhaustive(value: $name) {
                match value {
                    $($name::$variant => {})+
                }
            }
        };
    };
}
