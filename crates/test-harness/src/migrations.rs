//! Applying the repository's `migrations/` to a test database.
//!
//! Tests read the SQL files from disk, as they are in the repository, so what
//! the tests exercise is exactly what users apply. (The walbox binary embeds
//! the same files for `walbox migrate`; a test there checks both lists agree.)

use std::path::PathBuf;

use tokio_postgres::Client;

/// The repository's `migrations/` directory.
pub fn migrations_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../migrations")
}

/// The numbered migration files (`NNNN_name.sql`), in the order they apply.
pub fn migration_files() -> Vec<PathBuf> {
    let dir = migrations_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("read_dir entry").path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "sql")
                && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                    n.len() > 5 && n.as_bytes()[..4].iter().all(u8::is_ascii_digit)
                })
        })
        .collect();
    files.sort();
    files
}

/// Applies every numbered migration, in order, each in its own transaction.
pub async fn apply_migrations(client: &Client) {
    for file in migration_files() {
        apply_sql_file(client, &file).await;
    }
}

/// Applies one SQL file in a transaction.
pub async fn apply_sql_file(client: &Client, file: &std::path::Path) {
    let sql =
        std::fs::read_to_string(file).unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
    client
        .batch_execute(&format!("BEGIN;\n{sql}\nCOMMIT;"))
        .await
        .unwrap_or_else(|e| panic!("apply {}: {e}", file.display()));
}
