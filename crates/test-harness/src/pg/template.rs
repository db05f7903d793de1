//! Finding the Postgres binaries, and the `initdb` template each private
//! server copies.

use super::SUPERUSER;
use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Finds the directory holding `initdb` and `postgres`: `WALBOX_PG_BIN`, else
/// `pg_config --bindir`, else the newest `/usr/lib/postgresql/*/bin`.
pub fn find_bin_dir() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("WALBOX_PG_BIN").filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        if dir.join("postgres").is_file() {
            return Ok(dir);
        }
        return Err(format!(
            "WALBOX_PG_BIN={} holds no `postgres` binary; point it at the directory with initdb and postgres",
            dir.display()
        ));
    }
    let has_server = |d: &Path| d.join("postgres").is_file() && d.join("initdb").is_file();
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && has_server(&dir) {
            return Ok(dir);
        }
    }
    let mut candidates: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            has_server(&bin).then_some((version, bin))
        })
        .collect();
    candidates.sort();
    candidates.pop().map(|(_, dir)| dir).ok_or_else(|| {
        "no Postgres server binaries found: install them (Debian: apt-get install postgresql), \
         set WALBOX_PG_BIN to their directory, or set WALBOX_TEST_PG_URL to a server with wal_level=logical"
            .to_owned()
    })
}

/// The user and group a server runs as: `postgres` when this process is root
/// (Postgres refuses to run as root), otherwise the current user.
pub(super) fn run_as() -> Result<Option<(u32, u32)>, String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    let name = std::ffi::CString::new(SUPERUSER).expect("no NUL");
    // SAFETY: getpwnam returns NULL or a pointer to a static passwd record; we
    // read two integers from it at once, before any other getpw* call.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    if pw.is_null() {
        return Err(
            "running as root, but there is no `postgres` user to run the test server as \
             (Debian's postgresql package creates it; or: useradd --system postgres)"
                .to_owned(),
        );
    }
    // SAFETY: pw is non-null and points to a valid passwd record.
    Ok(Some(unsafe { ((*pw).pw_uid, (*pw).pw_gid) }))
}

pub(super) fn chown(path: &Path, owner: Option<(u32, u32)>) -> Result<(), String> {
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .map_err(|e| format!("chown {}: {e}", path.display()))?;
    }
    Ok(())
}

pub(super) fn run(cmd: &mut Command, what: &str) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{what}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    Err(format!("{what} failed ({}): {last}", out.status))
}

pub(super) fn postgres_version(bin_dir: &Path) -> Result<String, String> {
    let out = Command::new(bin_dir.join("postgres"))
        .arg("--version")
        .output()
        .map_err(|e| format!("run {}/postgres --version: {e}", bin_dir.display()))?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// A data directory made by `initdb` once per binary version and user, copied
/// by every server that starts from those binaries.
pub(super) fn template_dir(bin_dir: &Path, owner: Option<(u32, u32)>) -> Result<PathBuf, String> {
    let version = postgres_version(bin_dir)?;
    // FNV-1a over the binaries' path and version: a stable, short directory name.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bin_dir
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .chain(version.as_bytes())
    {
        hash = (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let dir = std::env::temp_dir().join(format!("walbox-pg-template-{uid}-{hash:016x}"));
    if dir.join(".walbox-ready").is_file() {
        return Ok(dir);
    }
    // Build beside it and rename into place, so concurrent test processes
    // never see a half-made template.
    let staging = std::env::temp_dir().join(format!(
        "walbox-pg-template-{uid}-{hash:016x}.{}",
        std::process::id()
    ));
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir(&staging).map_err(|e| format!("create {}: {e}", staging.display()))?;
    chown(&staging, owner)?;
    let data = staging.join("data");
    let mut initdb = Command::new(bin_dir.join("initdb"));
    initdb
        .arg("-D")
        .arg(&data)
        .args([
            "-U",
            SUPERUSER,
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        ])
        .stdin(Stdio::null());
    if let Some((uid, gid)) = owner {
        initdb.uid(uid).gid(gid);
    }
    if let Err(e) = run(&mut initdb, "initdb") {
        let _ = fs::remove_dir_all(&staging);
        return Err(e);
    }
    fs::write(staging.join(".walbox-ready"), version.as_bytes())
        .map_err(|e| format!("write template marker: {e}"))?;
    match fs::rename(&staging, &dir) {
        Ok(()) => Ok(dir),
        // Another process finished first: use its template.
        Err(_) if dir.join(".walbox-ready").is_file() => {
            let _ = fs::remove_dir_all(&staging);
            Ok(dir)
        }
        Err(e) => Err(format!(
            "rename {} to {}: {e}",
            staging.display(),
            dir.display()
        )),
    }
}
