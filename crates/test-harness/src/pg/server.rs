//! A private server's process: started from the template, stopped by
//! `Drop`, killed with the test process.

use std::fs;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tokio_postgres::Config;

use super::template::*;
use super::{
    connect, server_version_num, CONNECT_TIMEOUT, DEFAULT_SETTINGS, START_TIMEOUT, STOP_TIMEOUT,
    SUPERUSER,
};
use crate::wait::wait_for_blocking;

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

    /// Changes a setting (`-c name=value`) for the next [`PgServer::start`]:
    /// settings given on the command line win over `ALTER SYSTEM`, so a test
    /// that fixes a server setting stops the server, sets it here and starts
    /// it again.
    pub fn set_setting(&mut self, name: &str, value: &str) {
        self.settings.retain(|(k, _)| k != name);
        self.settings.push((name.to_owned(), value.to_owned()));
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

impl PgServer {
    /// Stops the server at once and removes its directory, from an `atexit`
    /// hook (where `Drop` does not run).
    pub(super) fn stop_at_exit(&self) {
        if let Some(running) = &self.running {
            stop_process(running, libc::SIGQUIT);
        }
        let _ = fs::remove_dir_all(self.root.path());
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        // The directory is removed right after, so skip the shutdown checkpoint.
        self.stop_with(libc::SIGQUIT);
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
