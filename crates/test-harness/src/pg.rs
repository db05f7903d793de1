//! Postgres for tests: a private server started from local binaries, or the
//! server named by `WALBOX_TEST_PG_URL`, and a fresh database per test.
//!
//! # Lifetime of a private server
//!
//! The `postgres` process is spawned from a supervisor thread that lives as long
//! as the server and waits on it. The child asks the kernel for a parent-death
//! signal (`PR_SET_PDEATHSIG` = `SIGQUIT`, Postgres' immediate shutdown), so
//! whatever ends the test process — a normal exit, a panic, `kill -9` — also
//! ends the server: no orphan `postgres` processes. [`PgServer`]'s `Drop` and,
//! for the process-wide [`shared`] server, an `atexit` hook stop it cleanly and
//! remove its directory.
//!
//! `initdb` runs once per binary version and user into a template directory
//! under the system temp dir; each server copies it, which is much faster than
//! a fresh `initdb` in every test process.

use std::fmt::Write as _;
use std::fs;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config, NoTls};

use crate::wait::wait_for_blocking;

/// Settings every private server gets: logical decoding, room for many slots,
/// a short `wal_sender_timeout` so a stuck client is noticed in tests, and no
/// fsync (a test server's data need not survive an OS crash).
pub const DEFAULT_SETTINGS: &[(&str, &str)] = &[
    ("listen_addresses", "127.0.0.1"),
    ("wal_level", "logical"),
    ("max_replication_slots", "20"),
    ("max_wal_senders", "20"),
    ("wal_sender_timeout", "10s"),
    ("max_connections", "100"),
    ("fsync", "off"),
    ("full_page_writes", "off"),
    ("max_prepared_transactions", "10"),
];

/// The superuser of private servers.
pub const SUPERUSER: &str = "postgres";

/// How long a server may take to accept connections or to stop.
const START_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a configured server (`WALBOX_TEST_PG_URL`) may take to answer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

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
fn run_as() -> Result<Option<(u32, u32)>, String> {
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

fn chown(path: &Path, owner: Option<(u32, u32)>) -> Result<(), String> {
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .map_err(|e| format!("chown {}: {e}", path.display()))?;
    }
    Ok(())
}

fn run(cmd: &mut Command, what: &str) -> Result<(), String> {
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

fn postgres_version(bin_dir: &Path) -> Result<String, String> {
    let out = Command::new(bin_dir.join("postgres"))
        .arg("--version")
        .output()
        .map_err(|e| format!("run {}/postgres --version: {e}", bin_dir.display()))?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// A data directory made by `initdb` once per binary version and user, copied
/// by every server that starts from those binaries.
fn template_dir(bin_dir: &Path, owner: Option<(u32, u32)>) -> Result<PathBuf, String> {
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

const SERVER_DIR_PREFIX: &str = "walbox-pg-";
/// Names the test process that owns a server directory.
const OWNER_FILE: &str = "owner.pid";

/// Removes server directories left by test processes that were killed
/// (`kill -9` runs no cleanup; the server itself died with its owner).
fn sweep_abandoned_dirs() {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let is_server_dir = entry.file_name().to_str().is_some_and(|n| {
            n.starts_with(SERVER_DIR_PREFIX) && !n.starts_with("walbox-pg-template-")
        });
        if !is_server_dir {
            continue;
        }
        let Some(owner) = fs::read_to_string(path.join(OWNER_FILE))
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        else {
            continue; // being created right now, or not ours
        };
        // SAFETY: kill with signal 0 only checks that the process exists.
        let alive = unsafe { libc::kill(owner, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        if !alive {
            let _ = fs::remove_dir_all(&path);
        }
    }
}

/// Configures a private Postgres server before it starts.
#[derive(Clone, Debug, Default)]
pub struct PgServerBuilder {
    bin_dir: Option<PathBuf>,
    settings: Vec<(String, String)>,
    hba: Option<String>,
    files: Vec<(String, Vec<u8>)>,
}

impl PgServerBuilder {
    /// Uses the server binaries in `dir` instead of [`find_bin_dir`]'s choice.
    pub fn bin_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.bin_dir = Some(dir.into());
        self
    }

    /// Sets a server setting (`-c name=value`), overriding [`DEFAULT_SETTINGS`].
    pub fn setting(mut self, name: &str, value: &str) -> Self {
        self.settings.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Replaces `pg_hba.conf` with `contents`.
    pub fn hba(mut self, contents: &str) -> Self {
        self.hba = Some(contents.to_owned());
        self
    }

    /// Writes a file into the data directory (mode 0600, owned by the server's
    /// user), e.g. a TLS key and certificate named by `ssl_key_file`.
    pub fn file(mut self, name: &str, contents: impl Into<Vec<u8>>) -> Self {
        self.files.push((name.to_owned(), contents.into()));
        self
    }

    /// Creates the data directory and starts the server; returns once it
    /// accepts connections.
    pub fn start(self) -> Result<PgServer, String> {
        let bin_dir = match self.bin_dir {
            Some(d) => d,
            None => find_bin_dir()?,
        };
        let owner = run_as()?;
        let template = template_dir(&bin_dir, owner)?;
        sweep_abandoned_dirs();
        let root = server_root(owner)?;
        let data = root.path().join("data");
        run(
            Command::new("cp")
                .arg("-a")
                .arg(template.join("data"))
                .arg(&data),
            "copy the template data directory",
        )?;
        if let Some(hba) = &self.hba {
            write_owned(&data.join("pg_hba.conf"), hba.as_bytes(), owner)?;
        }
        for (name, contents) in &self.files {
            write_owned(&data.join(name), contents, owner)?;
        }
        let mut settings: Vec<(String, String)> = DEFAULT_SETTINGS
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .filter(|(k, _)| !self.settings.iter().any(|(sk, _)| sk == k))
            .collect();
        settings.extend(self.settings);
        let mut server = PgServer {
            bin_dir,
            root,
            port: 0,
            owner,
            settings,
            running: None,
        };
        // A free port can be taken between choosing and binding it: try a few.
        let mut last_err = String::new();
        for _ in 0..3 {
            server.port = crate::port::free_port();
            match server.start() {
                Ok(()) => return Ok(server),
                Err(e)
                    if e.contains("Address already in use")
                        || e.contains("could not create any TCP/IP sockets") =>
                {
                    last_err = e
                }
                Err(e) => return Err(e),
            }
        }
        Err(last_err)
    }
}

/// A server's directory (data, socket, log), marked as this process's so
/// that [`sweep_abandoned_dirs`] leaves it alone while the process lives.
fn server_root(owner: Option<(u32, u32)>) -> Result<tempfile::TempDir, String> {
    let root = tempfile::Builder::new()
        .prefix(SERVER_DIR_PREFIX)
        .tempdir()
        .map_err(|e| format!("create a temp dir: {e}"))?;
    fs::write(root.path().join(OWNER_FILE), std::process::id().to_string())
        .map_err(|e| format!("write {}: {e}", root.path().display()))?;
    chown(root.path(), owner)?;
    Ok(root)
}

fn write_owned(path: &Path, contents: &[u8], owner: Option<(u32, u32)>) -> Result<(), String> {
    fs::write(path, contents).map_err(|e| format!("write {}: {e}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("chmod {}: {e}", path.display()))?;
    chown(path, owner)
}

/// The exit of a server process, as seen by its supervisor thread.
#[derive(Default)]
struct ExitSlot {
    status: Mutex<Option<std::io::Result<ExitStatus>>>,
    changed: Condvar,
}

impl ExitSlot {
    fn wait(&self, timeout: Duration) -> bool {
        let guard = self.status.lock().unwrap_or_else(|p| p.into_inner());
        let (guard, _) = self
            .changed
            .wait_timeout_while(guard, timeout, |s| s.is_none())
            .unwrap_or_else(|p| p.into_inner());
        guard.is_some()
    }

    fn has_exited(&self) -> bool {
        self.status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }
}

struct Running {
    pid: i32,
    exit: Arc<ExitSlot>,
}

/// A private Postgres server in a temporary directory, listening on
/// `127.0.0.1` and a socket directory beside its data. Dropping it stops the
/// server and removes the directory.
pub struct PgServer {
    bin_dir: PathBuf,
    root: tempfile::TempDir,
    port: u16,
    owner: Option<(u32, u32)>,
    settings: Vec<(String, String)>,
    running: Option<Running>,
}

impl std::fmt::Debug for PgServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgServer")
            .field("port", &self.port)
            .field("data_dir", &self.data_dir())
            .field("pid", &self.pid())
            .finish()
    }
}

impl PgServer {
    /// A builder for a server with extra settings, pg_hba rules or files.
    pub fn builder() -> PgServerBuilder {
        PgServerBuilder::default()
    }

    /// A physical standby of `primary`, streaming through the physical slot
    /// `slot` (created here): a base backup taken with `pg_backup_start` /
    /// `pg_backup_stop` (the npm builds have no `pg_basebackup`, and
    /// Debian's refuses newer servers), `standby.signal`, and Postgres 17's
    /// slot synchronization (`sync_replication_slots`, `hot_standby_feedback`)
    /// so that failover slots follow it. Returns once it accepts connections.
    pub async fn standby_of(primary: &PgServer, slot: &str) -> Result<PgServer, String> {
        let admin = connect(&primary.config("postgres"))
            .await
            .map_err(|e| format!("connect to the primary: {e}"))?;
        admin
            .execute(
                "SELECT pg_create_physical_replication_slot($1, true)",
                &[&slot],
            )
            .await
            .map_err(|e| format!("create the physical slot {slot}: {e}"))?;
        admin
            .execute("SELECT pg_backup_start('walbox standby', true)", &[])
            .await
            .map_err(|e| format!("pg_backup_start: {e}"))?;
        let root = server_root(primary.owner)?;
        let data = root.path().join("data");
        run(
            Command::new("cp")
                .arg("-a")
                .arg(primary.data_dir())
                .arg(&data),
            "copy the primary's data directory",
        )?;
        for leftover in ["postmaster.pid", "postmaster.opts"] {
            let _ = fs::remove_file(data.join(leftover));
        }
        // The primary's wait for this standby (ALTER SYSTEM) is not the
        // standby's: once promoted, it would wait for a slot it lacks.
        let auto_conf = data.join("postgresql.auto.conf");
        if let Ok(text) = fs::read_to_string(&auto_conf) {
            let kept: String = text
                .lines()
                .filter(|l| !l.trim_start().starts_with("synchronized_standby_slots"))
                .map(|l| format!("{l}\n"))
                .collect();
            write_owned(&auto_conf, kept.as_bytes(), primary.owner)?;
        }
        // The primary's slots are not the standby's.
        if let Ok(entries) = fs::read_dir(data.join("pg_replslot")) {
            for e in entries.flatten() {
                let _ = fs::remove_dir_all(e.path());
            }
        }
        let row = admin
            .query_one(
                "SELECT labelfile, spcmapfile FROM pg_backup_stop(true)",
                &[],
            )
            .await
            .map_err(|e| format!("pg_backup_stop: {e}"))?;
        let (label, spcmap): (String, Option<String>) = (row.get(0), row.get(1));
        write_owned(&data.join("backup_label"), label.as_bytes(), primary.owner)?;
        if let Some(map) = spcmap.filter(|m| !m.is_empty()) {
            write_owned(&data.join("tablespace_map"), map.as_bytes(), primary.owner)?;
        }
        write_owned(&data.join("standby.signal"), b"", primary.owner)?;
        // The primary's own wait for this standby is not the standby's setting.
        let mut settings: Vec<(String, String)> = primary
            .settings
            .iter()
            .filter(|(k, _)| k != "synchronized_standby_slots")
            .cloned()
            .collect();
        settings.extend(
            [
                (
                    "primary_conninfo",
                    format!(
                        "host={} port={} user={SUPERUSER} dbname=postgres application_name=walbox_standby",
                        primary.socket_dir().display(),
                        primary.port()
                    ),
                ),
                ("primary_slot_name", slot.to_owned()),
                ("hot_standby_feedback", "on".to_owned()),
            ]
            .map(|(k, v)| (k.to_owned(), v)),
        );
        // Failover slots are synchronized from Postgres 17 (an unknown
        // setting stops an older server).
        if server_version_num(&admin).await >= 170_000 {
            settings.push(("sync_replication_slots".into(), "on".into()));
        }
        let mut server = PgServer {
            bin_dir: primary.bin_dir.clone(),
            root,
            port: crate::port::free_port(),
            owner: primary.owner,
            settings,
            running: None,
        };
        server.start()?;
        Ok(server)
    }

    /// Starts a server with [`DEFAULT_SETTINGS`].
    pub fn start_default() -> Result<PgServer, String> {
        Self::builder().start()
    }

    /// The TCP port the server listens on (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.root.path().join("data")
    }

    /// The directory holding the server's Unix socket.
    pub fn socket_dir(&self) -> &Path {
        self.root.path()
    }

    /// The directory of the binaries this server runs.
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// The postmaster's process id, while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.running
            .as_ref()
            .filter(|r| !r.exit.has_exited())
            .map(|r| r.pid)
    }

    /// Connection settings for `dbname` as the superuser, over TCP.
    pub fn config(&self, dbname: &str) -> Config {
        let mut c = Config::new();
        c.host("127.0.0.1")
            .port(self.port)
            .user(SUPERUSER)
            .dbname(dbname)
            .connect_timeout(CONNECT_TIMEOUT);
        c
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.root.path().join("postgres.log")).unwrap_or_default()
    }

    /// Starts the server again after [`PgServer::stop`] (same data, same port).
    pub fn start(&mut self) -> Result<(), String> {
        if self.pid().is_some() {
            return Ok(());
        }
        let data = self.data_dir();
        // A server stopped by SIGQUIT or SIGKILL leaves its pid file behind.
        let _ = fs::remove_file(data.join("postmaster.pid"));
        let log_path = self.root.path().join("postgres.log");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| format!("open {}: {e}", log_path.display()))?;
        chown(&log_path, self.owner)?;
        let log_offset = log.metadata().map(|m| m.len()).unwrap_or(0);
        let mut cmd = Command::new(self.bin_dir.join("postgres"));
        cmd.arg("-D")
            .arg(&data)
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-k")
            .arg(self.root.path());
        for (k, v) in &self.settings {
            cmd.arg("-c").arg(format!("{k}={v}"));
        }
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        if let Some((uid, gid)) = self.owner {
            cmd.uid(uid).gid(gid);
        }
        let parent = std::process::id();
        // SAFETY: the closure runs in the forked child before exec and only
        // makes async-signal-safe system calls (prctl, getppid, _exit).
        unsafe {
            cmd.pre_exec(move || {
                // Die with the thread that spawned us (the supervisor below,
                // which lives as long as the test process).
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGQUIT) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died before prctl took effect.
                if libc::getppid() as u32 != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let exit = Arc::new(ExitSlot::default());
        let (pid_tx, pid_rx) = std::sync::mpsc::channel();
        let thread_exit = Arc::clone(&exit);
        std::thread::Builder::new()
            .name(format!("postgres-{}", self.port))
            .spawn(move || match cmd.spawn() {
                Err(e) => {
                    let _ = pid_tx.send(Err(e));
                }
                Ok(mut child) => {
                    let _ = pid_tx.send(Ok(child.id()));
                    let status = child.wait();
                    *thread_exit.status.lock().unwrap_or_else(|p| p.into_inner()) = Some(status);
                    thread_exit.changed.notify_all();
                }
            })
            .map_err(|e| format!("spawn the postgres supervisor thread: {e}"))?;
        let pid = pid_rx
            .recv()
            .map_err(|_| "the postgres supervisor thread died".to_owned())?
            .map_err(|e| format!("start {}/postgres: {e}", self.bin_dir.display()))?;
        self.running = Some(Running {
            pid: pid as i32,
            exit: Arc::clone(&exit),
        });
        let pid_file = data.join("postmaster.pid");
        let ready = wait_for_blocking("postgres to accept connections", START_TIMEOUT, || {
            if exit.has_exited() {
                return Ok(false);
            }
            // Line 8 of postmaster.pid is the postmaster's status; "ready" once it accepts connections.
            let status = fs::read_to_string(&pid_file).unwrap_or_default();
            match status.lines().nth(7).map(str::trim) {
                Some("ready") => Ok(true),
                other => Err(format!("status {other:?}")),
            }
        });
        match ready {
            Ok(true) => Ok(()),
            Ok(false) | Err(_) => {
                self.stop_with(libc::SIGQUIT);
                let new_log = self
                    .log()
                    .get(log_offset as usize..)
                    .unwrap_or_default()
                    .to_owned();
                let reason = new_log
                    .lines()
                    .filter(|l| {
                        l.contains("FATAL") || l.contains("ERROR") || l.contains("LOG:  could not")
                    })
                    .map(str::trim)
                    .collect::<Vec<_>>()
                    .join(" | ");
                Err(format!(
                    "the test Postgres on port {} did not start: {}",
                    self.port,
                    if reason.is_empty() {
                        ready.err().unwrap_or_else(|| "it exited".into())
                    } else {
                        reason
                    }
                ))
            }
        }
    }

    /// Copies the data directory of the stopped server aside, as a disk
    /// snapshot would; [`PgServer::restore`] brings it back. The copy keeps
    /// the system identifier and timeline: a server started on it is the
    /// same history to any client, with its WAL ending where the copy was
    /// taken.
    pub fn snapshot(&self, name: &str) -> Result<(), String> {
        if self.pid().is_some() {
            return Err("snapshot: stop the server first".into());
        }
        let to = self.root.path().join(format!("snapshot-{name}"));
        copy_tree(&self.data_dir(), &to)
    }

    /// Replaces the stopped server's data directory with the snapshot
    /// `name`; [`PgServer::start`] then starts the restored server.
    pub fn restore(&mut self, name: &str) -> Result<(), String> {
        if self.pid().is_some() {
            return Err("restore: stop the server first".into());
        }
        let from = self.root.path().join(format!("snapshot-{name}"));
        let data = self.data_dir();
        fs::remove_dir_all(&data).map_err(|e| format!("remove {}: {e}", data.display()))?;
        copy_tree(&from, &data)
    }

    /// Stops the server with a fast shutdown (open sessions are disconnected).
    pub fn stop(&mut self) {
        self.stop_with(libc::SIGINT);
    }

    /// Stops the server as a crash would: immediate shutdown (`SIGQUIT`), no
    /// checkpoint; the next start runs crash recovery.
    pub fn stop_immediate(&mut self) {
        self.stop_with(libc::SIGQUIT);
    }

    fn stop_with(&mut self, signal: i32) {
        if let Some(running) = self.running.take() {
            stop_process(&running, signal);
        }
    }
}

/// `cp -a`: a directory tree with its modes and owners (the data directory
/// belongs to the user the server runs as, mode 0700).
fn copy_tree(from: &Path, to: &Path) -> Result<(), String> {
    let out = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .output()
        .map_err(|e| format!("run cp: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "cp -a {} {}: {}",
            from.display(),
            to.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn stop_process(running: &Running, signal: i32) {
    if running.exit.has_exited() {
        return;
    }
    // SAFETY: kill has no memory-safety preconditions; the pid is our child,
    // not yet reaped (its supervisor would have recorded the exit).
    unsafe { libc::kill(running.pid, signal) };
    if !running.exit.wait(STOP_TIMEOUT) {
        // SAFETY: as above.
        unsafe { libc::kill(running.pid, libc::SIGKILL) };
        running.exit.wait(STOP_TIMEOUT);
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        // The directory is removed right after, so skip the shutdown checkpoint.
        self.stop_with(libc::SIGQUIT);
    }
}

/// Builds a libpq keyword/value connection string (`host=… port=… …`) from
/// tokio-postgres settings; values are quoted, so any password works. Usable
/// by walbox, tokio-postgres, psql and pg_recvlogical alike.
pub fn conninfo(config: &Config) -> String {
    let mut out = String::new();
    let mut push = |key: &str, value: &str| {
        if !out.is_empty() {
            out.push(' ');
        }
        let escaped = value.replace('\\', "\\\\").replace('\'', "\\'");
        let _ = write!(out, "{key}='{escaped}'");
    };
    if let Some(host) = config.get_hosts().first() {
        match host {
            Host::Tcp(h) => push("host", h),
            Host::Unix(p) => push("host", &p.to_string_lossy()),
        }
    }
    if let Some(port) = config.get_ports().first() {
        push("port", &port.to_string());
    }
    if let Some(user) = config.get_user() {
        push("user", user);
    }
    if let Some(password) = config.get_password() {
        push("password", &String::from_utf8_lossy(password));
    }
    if let Some(dbname) = config.get_dbname() {
        push("dbname", dbname);
    }
    out
}

/// Describes a connection target without its password, for messages.
pub fn describe(config: &Config) -> String {
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "localhost".into(),
    };
    format!(
        "host={host} port={} user={} dbname={}",
        config.get_ports().first().copied().unwrap_or(5432),
        config.get_user().unwrap_or("?"),
        config.get_dbname().unwrap_or("?"),
    )
}

/// The server's `server_version_num` (e.g. 170004), for tests whose
/// expectations depend on the Postgres version.
///
/// # Panics
///
/// When the query fails.
pub async fn server_version_num(client: &Client) -> i32 {
    client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .expect("read server_version_num")
        .get(0)
}

/// Connects and spawns the connection task on the current tokio runtime.
pub async fn connect(config: &Config) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        // The error, if any, also fails the client's next query; nothing to add here.
        let _ = connection.await;
    });
    Ok(client)
}

/// Checks that a server can run walbox tests: it answers within 10 s, has
/// `wal_level=logical`, and the user may replicate. The error is one line that
/// says what to change. `source` names where the target came from.
pub async fn check_server(config: &Config, source: &str) -> Result<(), String> {
    let target = describe(config);
    let client = match tokio::time::timeout(CONNECT_TIMEOUT, connect(config)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            let cause = std::error::Error::source(&e)
                .map(|s| format!(": {s}"))
                .unwrap_or_default();
            return Err(format!(
                "{source} ({target}) did not accept a connection: {e}{cause}"
            ));
        }
        Err(_) => {
            return Err(format!(
                "{source} ({target}) did not answer within {CONNECT_TIMEOUT:?}"
            ))
        }
    };
    let row = client
        .query_one(
            "SELECT current_setting('wal_level'), \
                    (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user), \
                    current_setting('max_replication_slots')::int",
            &[],
        )
        .await
        .map_err(|e| format!("{source} ({target}): query server settings: {e}"))?;
    let wal_level: String = row.get(0);
    let may_replicate: bool = row.get(1);
    let max_slots: i32 = row.get(2);
    if wal_level != "logical" {
        return Err(format!(
            "{source} ({target}) has wal_level={wal_level}; walbox tests need wal_level=logical \
             (set it in postgresql.conf and restart the server)"
        ));
    }
    if !may_replicate {
        return Err(format!(
            "{source} ({target}): the user may not replicate; grant it with ALTER ROLE … REPLICATION"
        ));
    }
    if max_slots < 10 {
        return Err(format!(
            "{source} ({target}) has max_replication_slots={max_slots}; walbox tests need at least 10"
        ));
    }
    Ok(())
}

enum SharedKind {
    /// `WALBOX_TEST_PG_URL`.
    External,
    /// A private server owned by this process.
    Private(PgServer),
    #[cfg(feature = "docker")]
    Docker(crate::docker::Containers),
}

/// The Postgres server this test process uses: see [`shared`].
pub struct SharedPg {
    admin: Config,
    kind: SharedKind,
}

impl SharedPg {
    /// Settings for the maintenance database (`postgres`, or the URL's own).
    pub fn admin_config(&self) -> &Config {
        &self.admin
    }

    /// True when the server is the one named by `WALBOX_TEST_PG_URL`, shared
    /// with other processes: tests that restart or reconfigure the server must
    /// start a private one instead.
    pub fn is_external(&self) -> bool {
        matches!(self.kind, SharedKind::External)
    }

    /// The Kafka bootstrap list of the Docker Kafka container, when
    /// `WALBOX_TEST_DOCKER=1` supplied the environment.
    pub fn docker_kafka(&self) -> Option<&str> {
        match &self.kind {
            #[cfg(feature = "docker")]
            SharedKind::Docker(c) => Some(&c.kafka_bootstrap),
            _ => None,
        }
    }

    /// The private server, when this process started one.
    pub fn private_server(&self) -> Option<&PgServer> {
        match &self.kind {
            SharedKind::Private(s) => Some(s),
            _ => None,
        }
    }
}

static SHARED: OnceLock<Result<SharedPg, String>> = OnceLock::new();

/// Stops the shared private server when the process exits normally (also
/// after a test panicked). A killed process is covered by the parent-death signal.
extern "C" fn stop_shared_at_exit() {
    if let Some(Ok(SharedPg {
        kind: SharedKind::Private(server),
        ..
    })) = SHARED.get()
    {
        if let Some(running) = &server.running {
            stop_process(running, libc::SIGQUIT);
        }
        let _ = fs::remove_dir_all(server.root.path());
    }
}

fn init_shared() -> Result<SharedPg, String> {
    #[cfg(feature = "docker")]
    if std::env::var("WALBOX_TEST_DOCKER").is_ok_and(|v| v == "1") {
        let (containers, admin) = crate::docker::start()?;
        return Ok(SharedPg {
            admin,
            kind: SharedKind::Docker(containers),
        });
    }
    #[cfg(not(feature = "docker"))]
    if std::env::var("WALBOX_TEST_DOCKER").is_ok_and(|v| v == "1") {
        return Err(
            "WALBOX_TEST_DOCKER=1 needs the harness built with its `docker` feature \
                    (cargo test --features walbox-test-harness/docker)"
                .to_owned(),
        );
    }
    let (admin, kind, source) = match std::env::var("WALBOX_TEST_PG_URL")
        .ok()
        .filter(|u| !u.is_empty())
    {
        Some(url) => {
            let admin: Config = url
                .parse()
                .map_err(|e| format!("WALBOX_TEST_PG_URL is not a valid connection string: {e}"))?;
            (admin, SharedKind::External, "WALBOX_TEST_PG_URL")
        }
        None => {
            let server = PgServer::start_default()?;
            // SAFETY: registers a plain extern "C" fn with no captured state.
            unsafe { libc::atexit(stop_shared_at_exit) };
            (
                server.config("postgres"),
                SharedKind::Private(server),
                "the private test Postgres",
            )
        }
    };
    let check_config = admin.clone();
    // This runs from inside test runtimes, where blocking on another runtime
    // is not allowed: check from a thread with its own.
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?
            .block_on(check_server(&check_config, source))
    })
    .join()
    .map_err(|_| "the server check panicked".to_owned())??;
    Ok(SharedPg { admin, kind })
}

/// The Postgres server of this test process, started or checked on first use.
///
/// `WALBOX_TEST_PG_URL` names an existing server (shared by every test
/// process); otherwise a private one starts. Either way it is checked once:
/// reachable, `wal_level=logical`, a user that may replicate.
///
/// # Panics
///
/// With one line saying what is wrong when the server cannot be had.
pub fn shared() -> &'static SharedPg {
    match try_shared() {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    }
}

/// [`shared`], returning the one-line error instead of panicking.
pub fn try_shared() -> Result<&'static SharedPg, String> {
    SHARED
        .get_or_init(init_shared)
        .as_ref()
        .map_err(Clone::clone)
}

/// A database made for one test. On a shared server
/// (`WALBOX_TEST_PG_URL`) it is dropped again, with its replication slots,
/// when this value is dropped; a private server goes away as a whole.
pub struct TestDb {
    name: String,
    config: Config,
    cleanup: Option<Config>,
}

impl std::fmt::Debug for TestDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestDb")
            .field("target", &describe(&self.config))
            .finish()
    }
}

impl TestDb {
    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Settings to connect to this database as the test superuser.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// A libpq connection string for this database (see [`conninfo`]).
    pub fn conninfo(&self) -> String {
        conninfo(&self.config)
    }

    /// A new client on this database.
    pub async fn connect(&self) -> Client {
        connect(&self.config)
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", describe(&self.config)))
    }
}

/// Creates a fresh database on the [`shared`] server.
pub async fn fresh_db() -> TestDb {
    fresh_db_on(shared().admin_config(), shared().is_external()).await
}

/// Creates a fresh database on the server `admin` points at. With
/// `drop_after`, the database (and its slots) is dropped with the [`TestDb`].
pub async fn fresh_db_on(admin: &Config, drop_after: bool) -> TestDb {
    let name = crate::unique_name("walbox_test");
    let client = connect(admin)
        .await
        .unwrap_or_else(|e| panic!("connect to {}: {e}", describe(admin)));
    client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap_or_else(|e| panic!("CREATE DATABASE {name}: {e}"));
    let mut config = admin.clone();
    config.dbname(&name);
    TestDb {
        name,
        config,
        cleanup: drop_after.then(|| admin.clone()),
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let Some(admin) = self.cleanup.take() else {
            return;
        };
        let name = self.name.clone();
        // Drop may run inside a runtime: clean up from a thread with its own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async move {
                let client = connect(&admin).await.ok()?;
                // Slots pin WAL on a shared server: drop the test's before its
                // database. One statement per call: DROP DATABASE cannot run in
                // the implicit transaction of a multi-statement query.
                for sql in [
                    format!(
                        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                          WHERE database = '{name}' AND active_pid IS NOT NULL"
                    ),
                    format!(
                        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                          WHERE database = '{name}'"
                    ),
                    format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
                ] {
                    let _ = client.batch_execute(&sql).await;
                }
                Some(())
            })
        })
        .join();
    }
}

/// Reads the server log for lines that match `needle` (for assertions on
/// what the server saw).
pub fn log_lines_matching(server: &PgServer, needle: &str) -> Vec<String> {
    BufReader::new(server.log().as_bytes())
        .lines()
        .map_while(Result::ok)
        .filter(|l| l.contains(needle))
        .collect()
}
