//! Links the hypervisor with its own linker script and a GNU build id (the analyzer matches the
//! image a sample log came from by this id).
fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:rerun-if-changed=linker.ld");
    println!("cargo:rustc-link-arg-bins=-T{dir}/linker.ld");
    println!("cargo:rustc-link-arg-bins=--build-id=sha1");
    println!("cargo:rustc-link-arg-bins=--no-pie");
}
