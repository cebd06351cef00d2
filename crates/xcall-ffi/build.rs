// Tells the C-test runner which target triple it runs on, so the `cc`
// crate can find the matching C and C++ compilers at test time; sets the
// shared library's soname.
fn main() {
    let target = std::env::var("TARGET").unwrap_or_default();
    println!("cargo:rustc-env=XCALL_BUILD_TARGET={target}");
    // A versioned soname: programs linked with -lxcall record
    // "libxcall.so.<major>", so an incompatible xcall is never picked up by
    // an old program. Cargo writes the file as libxcall.so; CMake and the
    // device bundle add the versioned names (libxcall.so.0 ->
    // libxcall.so.0.1.0) next to it.
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libxcall.so.{major}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
