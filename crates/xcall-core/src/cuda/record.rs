//! Kernel parameters written once: a `#[repr(C)]` Rust struct, whose CUDA C
//! twin is generated from it together with `static_assert`s on its size and
//! every field's offset, so the two sides cannot drift apart unnoticed (a
//! mismatch fails the NVRTC compile). A kernel takes the struct by value as
//! its only parameter; [`crate::cuda::Params::record`] passes it.

/// A number a kernel parameter struct may hold. Sealed: the plain integer
/// and float types, whose every byte is meaningful.
pub trait ParamField: Copy + sealed::Sealed {}

mod sealed {
    pub trait Sealed {}
}

macro_rules! param_fields {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl ParamField for $t {}
    )*};
}
param_fields!(u64, i64, u32, i32, f32);

// An array of 8-byte words: with a C type `T*[N]`, `N` device pointers.
impl<const N: usize> sealed::Sealed for [u64; N] {}
impl<const N: usize> ParamField for [u64; N] {}

/// A kernel parameter struct shared with CUDA C. Implement it with
/// [`kernel_params!`](crate::kernel_params), never by hand.
///
/// # Safety
/// The type is `#[repr(C)]`, made only of [`ParamField`]s and has no
/// padding, so all of its bytes are initialised.
pub unsafe trait KernelRecord: Copy + 'static {
    /// The struct's name in CUDA C.
    const NAME: &'static str;

    /// Each field's (name, CUDA C type, byte offset, size), in order.
    fn fields() -> Vec<(&'static str, &'static str, usize, usize)>;

    /// Byte offsets of the 8-byte words that hold a device pointer (a
    /// field of C type ending in `*`, or each word of an array field of C
    /// type `T*[N]`), worked out once per type: a launch reads them
    /// without allocating.
    fn pointer_offsets() -> &'static [usize];

    /// The CUDA C definition, followed by `static_assert`s that its size
    /// and every field's size are the Rust struct's. With the fields in the
    /// Rust order and neither side padded (the sizes add up to the
    /// struct's), every offset agrees too. (NVRTC has no `offsetof`.)
    fn c_definition() -> String {
        let name = Self::NAME;
        let size = std::mem::size_of::<Self>();
        let fields = Self::fields();
        let mut s = format!("struct {name} {{\n");
        for (field, ctype, _, _) in &fields {
            // An array type `T[N]` is declared `T field[N]`.
            match ctype.find('[') {
                Some(at) => s += &format!("    {} {field}{};\n", &ctype[..at], &ctype[at..]),
                None => s += &format!("    {ctype} {field};\n"),
            }
        }
        s += "};\n";
        s += &format!(
            "static_assert(sizeof({name}) == {size}, \"{name}: the Rust struct is {size} bytes\");\n"
        );
        for (field, _, offset, bytes) in &fields {
            s += &format!(
                "static_assert(sizeof({name}::{field}) == {bytes}, \"{name}.{field} (at byte {offset}): the Rust field is {bytes} bytes\");\n"
            );
        }
        s
    }

    /// Checks CUDA source text against the struct: some function takes it
    /// as `p` (`Name p`, `Name& p`, `const Name& p`), and every `p.<field>`
    /// such a function reads is a field of the Rust struct. The error names
    /// the first field the struct lacks.
    fn check_reads(source: &str) -> std::result::Result<(), String> {
        let name = Self::NAME;
        let fields = Self::fields();
        let mut found = false;
        for (at, _) in source.match_indices(name) {
            let after = source[at + name.len()..].trim_start_matches('&');
            if !after.starts_with(" p)") && !after.starts_with(" p,") {
                continue;
            }
            found = true;
            for field in fields_read(function_body(&source[at..])) {
                if !fields.iter().any(|(f, ..)| *f == field) {
                    return Err(format!(
                        "the source reads {name}.{field}, which the Rust struct lacks"
                    ));
                }
            }
        }
        if found {
            Ok(())
        } else {
            Err(format!("no function of the source takes {name} p"))
        }
    }
}

/// The byte offsets of the pointers among `fields` (as
/// [`KernelRecord::fields`] lists them): a field of C type ending in `*`,
/// 8 bytes, 8-byte aligned; or every 8-byte word of an array field of C
/// type `T*[N]` (8-byte aligned, `8 * N` bytes).
pub fn pointer_offsets(fields: &[(&str, &str, usize, usize)]) -> Vec<usize> {
    fields
        .iter()
        .flat_map(|&(_, ctype, offset, size)| {
            let ctype = ctype.trim_end();
            let words = match ctype.find('[') {
                Some(at) if ctype[..at].trim_end().ends_with('*') => {
                    let n: Option<usize> = ctype[at + 1..]
                        .strip_suffix(']')
                        .and_then(|n| n.parse().ok());
                    n.filter(|&n| n * 8 == size).unwrap_or(0)
                }
                None if ctype.ends_with('*') && size == 8 => 1,
                _ => 0,
            };
            let words = if offset % 8 == 0 { words } else { 0 };
            (0..words).map(move |w| offset + 8 * w)
        })
        .collect()
}

/// The body (between its outer braces) of the first function in `text`.
fn function_body(text: &str) -> &str {
    let Some(start) = text.find('{') else {
        return "";
    };
    let mut depth = 0usize;
    for (i, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return &text[start + 1..start + i];
                }
            }
            _ => {}
        }
    }
    &text[start + 1..]
}

/// The names read as `p.<name>` in `body` (not `xp.<name>`), sorted, once
/// each.
fn fields_read(body: &str) -> Vec<String> {
    let mut used: Vec<String> = body
        .match_indices("p.")
        .filter(|(i, _)| {
            !body[..*i]
                .chars()
                .last()
                .is_some_and(|c| c.is_alphanumeric() || c == '_')
        })
        .map(|(i, _)| {
            body[i + 2..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect()
        })
        .collect();
    used.sort();
    used.dedup();
    used
}

/// Defines a `#[repr(C)]` kernel parameter struct and its CUDA C twin.
/// Each field is `name: rust_type => "c type"`; a padding byte, or a field
/// type that is not a [`ParamField`](crate::cuda::ParamField), fails the
/// build.
///
/// ```
/// xcall_core::kernel_params! {
///     /// What a copy kernel takes.
///     pub struct CopyParams {
///         /// Source (device address).
///         src: u64 => "const unsigned char*",
///         /// Destination (device address).
///         dst: u64 => "unsigned char*",
///         /// Bytes to copy.
///         bytes: i64 => "long long",
///     }
/// }
/// use xcall_core::cuda::KernelRecord;
/// assert!(CopyParams::c_definition().contains("long long bytes;"));
/// ```
#[macro_export]
macro_rules! kernel_params {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $( $(#[$fmeta:meta])* $field:ident : $ty:ty => $ctype:literal ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, PartialEq)]
        $vis struct $name {
            $( $(#[$fmeta])* pub $field: $ty, )*
        }

        const _: () = {
            const fn field<T: $crate::cuda::ParamField>() -> usize {
                ::std::mem::size_of::<T>()
            }
            assert!(
                0 $( + field::<$ty>() )* == ::std::mem::size_of::<$name>(),
                concat!(stringify!($name), " has padding: order its fields by size")
            );
        };

        // SAFETY: `#[repr(C)]`, every field a `ParamField` (checked above),
        // and the fields' sizes add up to the struct's: no padding.
        unsafe impl $crate::cuda::KernelRecord for $name {
            const NAME: &'static str = stringify!($name);

            fn pointer_offsets() -> &'static [usize] {
                static OFFSETS: ::std::sync::OnceLock<::std::vec::Vec<usize>> =
                    ::std::sync::OnceLock::new();
                OFFSETS.get_or_init(|| $crate::cuda::pointer_offsets(&Self::fields()))
            }

            fn fields() -> ::std::vec::Vec<(&'static str, &'static str, usize, usize)> {
                ::std::vec![
                    $( (
                        stringify!($field),
                        $ctype,
                        ::std::mem::offset_of!($name, $field),
                        ::std::mem::size_of::<$ty>(),
                    ), )*
                ]
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::kernel_params! {
        /// A test struct with mixed widths and no padding.
        struct Mixed {
            /// A pointer.
            a: u64 => "const float*",
            /// A count.
            b: i32 => "int",
            /// A scale.
            c: f32 => "float",
            /// A length.
            d: i64 => "long long",
        }
    }

    crate::kernel_params! {
        /// A test struct with an array of pointers.
        struct WithArray {
            /// A count.
            n: i64 => "long long",
            /// Three pointers.
            at: [u64; 3] => "unsigned char*[3]",
            /// One pointer.
            one: u64 => "const int*",
        }
    }

    #[test]
    fn an_array_field_is_declared_as_an_array_and_each_word_is_a_pointer() {
        let text = WithArray::c_definition();
        assert!(text.contains("    unsigned char* at[3];\n"), "{text}");
        assert!(
            text.contains("static_assert(sizeof(WithArray::at) == 24"),
            "{text}"
        );
        assert_eq!(WithArray::pointer_offsets(), &[8, 16, 24, 32]);
        // A size that does not match the declared length is no pointer.
        assert_eq!(
            pointer_offsets(&[("a", "unsigned char*[4]", 0, 24), ("b", "int[2]", 24, 8)]),
            Vec::<usize>::new()
        );
    }

    #[test]
    fn the_c_twin_lists_every_field_at_its_rust_offset() {
        let text = Mixed::c_definition();
        let expected =
            "struct Mixed {\n    const float* a;\n    int b;\n    float c;\n    long long d;\n};\n\
static_assert(sizeof(Mixed) == 24, \"Mixed: the Rust struct is 24 bytes\");\n\
static_assert(sizeof(Mixed::a) == 8, \"Mixed.a (at byte 0): the Rust field is 8 bytes\");\n\
static_assert(sizeof(Mixed::b) == 4, \"Mixed.b (at byte 8): the Rust field is 4 bytes\");\n\
static_assert(sizeof(Mixed::c) == 4, \"Mixed.c (at byte 12): the Rust field is 4 bytes\");\n\
static_assert(sizeof(Mixed::d) == 8, \"Mixed.d (at byte 16): the Rust field is 8 bytes\");\n";
        assert_eq!(text, expected);
        assert_eq!(Mixed::NAME, "Mixed");
    }

    #[test]
    fn reads_of_the_struct_are_checked_against_its_fields() {
        let good = "__device__ float f(const Mixed& p) { return p.c * p.d + xp.zz; }\n\
                    __global__ void k(Mixed p) { if (p.b) { g(p.a); } }";
        assert_eq!(Mixed::check_reads(good), Ok(()));
        let bad = "__global__ void k(Mixed p) { { p.a; } p.e; }";
        assert_eq!(
            Mixed::check_reads(bad),
            Err("the source reads Mixed.e, which the Rust struct lacks".into())
        );
        // A read after the function's closing brace is not the function's.
        assert_eq!(
            Mixed::check_reads("void k(Mixed p) { p.a; } void h(Other p) { p.q; }"),
            Ok(())
        );
        assert_eq!(
            Mixed::check_reads("void k(Mixed q) { q.a; }"),
            Err("no function of the source takes Mixed p".into())
        );
    }
}
