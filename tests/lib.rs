//! Helpers of the end-to-end tests in `e2e/`: where the `walbox` binary is.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The `walbox` binary of this workspace, built for the profile these tests
/// were built with (once per test process: cargo makes it a no-op when it is
/// up to date). `WALBOX_BIN` names another binary instead.
///
/// Cargo gives `CARGO_BIN_EXE_walbox` only to the tests of the binary's own
/// crate, so this crate asks cargo for it, and a plain `cargo test -p
/// walbox-e2e` never runs a stale binary.
pub fn walbox_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = std::env::var_os("WALBOX_BIN") {
            return PathBuf::from(bin);
        }
        // This test runs from <target>/<profile>/deps/.
        let exe = std::env::current_exe().expect("the test's own path");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("tests run from <target>/<profile>/deps");
        let target_dir = profile_dir.parent().expect("a target directory");
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") => "dev",
            Some(other) => other,
            None => "dev",
        };
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut command = Command::new(cargo);
        // Without the variables cargo set for this test: build scripts that
        // watch one (ring's watches CARGO_MANIFEST_DIR) would otherwise be
        // rebuilt here, and again by the next plain `cargo build`.
        for (name, _) in std::env::vars_os() {
            if name.to_str().is_some_and(set_for_a_test) {
                command.env_remove(&name);
            }
        }
        let status = command
            .args([
                "build",
                "--quiet",
                "-p",
                "walbox",
                "--bin",
                "walbox",
                "--profile",
                profile,
            ])
            .env("CARGO_TARGET_DIR", target_dir)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo to build walbox");
        assert!(status.success(), "building the walbox binary failed");
        profile_dir.join("walbox")
    })
}

/// Whether cargo sets the variable `name` for a crate it runs (and not for
/// the build it is asked to do).
fn set_for_a_test(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
        || matches!(
            name,
            "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_MANIFEST_LINKS"
                | "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
                | "CARGO_TARGET_TMPDIR"
                | "CARGO_RUSTC_CURRENT_DIR"
        )
}
