//! A fresh database per test, dropped after it.

use super::{connect, conninfo, describe, shared};
use tokio_postgres::{Client, Config};

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
