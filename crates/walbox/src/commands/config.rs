//! `walbox config`: checks the configuration as `walbox run` would and prints
//! the effective settings, secrets redacted, with where each came from.

use super::{loaded, CliError};
use crate::config::RunFlags;

/// Arguments of `walbox config`.
#[derive(Debug, clap::Args)]
pub struct ConfigArgs {
    /// Print the JSON Schema of walbox.toml (what the Helm chart validates
    /// `config` with) instead, and exit.
    #[arg(long)]
    json_schema: bool,
    #[command(flatten)]
    settings: RunFlags,
}

/// Validates everything `run` needs (the same checks, [`crate::config::Config::for_run`]); prints `key = value  (source)` lines.
pub fn run(args: ConfigArgs) -> Result<(), CliError> {
    if args.json_schema {
        let schema = crate::config::json_schema();
        println!(
            "{}",
            serde_json::to_string_pretty(&schema).unwrap_or_default()
        );
        return Ok(());
    }
    let config = loaded(args.settings.load())?;
    config.for_run()?;
    // To stderr, as `run` would log them: stdout stays the settings.
    for warning in config.warnings() {
        tracing::warn!("{warning}");
    }
    let rows = config.effective();
    let width = rows.iter().map(|(k, _, _)| k.len()).max().unwrap_or(0);
    for (key, value, source) in rows {
        let line = format!("{key:width$} = {value}  ({source})");
        println!("{}", crate::redaction::redact(&line));
    }
    Ok(())
}
