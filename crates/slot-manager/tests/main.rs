//! slot-manager against real Postgres servers from the test harness.

mod auth;
mod coverage;
mod lifecycle;
mod streaming;
mod tls;

use slot_manager::PgConfig;
use walbox_test_harness::pg::TestDb;

/// The test database's settings as a walbox connection string (no TLS).
pub fn pg_config(db: &TestDb) -> PgConfig {
    PgConfig::parse(&format!("{} sslmode=disable", db.conninfo())).unwrap()
}
