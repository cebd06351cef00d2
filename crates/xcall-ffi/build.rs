// Tells the C-test runner which target triple it runs on, so the `cc`
// crate can find the matching C and C++ compilers at test time; sets the
// shared library's soname.
fn main() {
    let target = std::env::var("TARGET").unwrap_or_default();
    println!("cargo:rustc-env=XCALL_BUILD_TARGET={target}");
    // Give libxcall.so a soname so programs record "libxcall.so", not a path.
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libxcall.so");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
