//! The settings as flags, generated from the table: each subcommand gets the
//! flags of the scopes it reads, with the variable named in `--help`.

use std::marker::PhantomData;
use std::path::PathBuf;

use clap::{Arg, ArgAction, ArgMatches, Args, Command, FromArgMatches};

use super::table::{Kind, Scope, SETTINGS};
use super::{Config, ConfigError, Sources};

/// A subcommand's reach into the settings.
pub trait Reach {
    /// The widest scope it reads.
    const SCOPE: Scope;
}

/// `--config FILE` and the flags of the settings up to `R::SCOPE`.
#[derive(Clone, Debug)]
pub struct Flags<R> {
    config: Option<PathBuf>,
    given: Vec<(&'static str, Vec<String>)>,
    _reach: PhantomData<R>,
}

/// Connection settings only (`migrate`).
#[derive(Clone, Copy, Debug)]
pub struct ConnectionReach;
/// Connection and mapping (`init-slot`, `status`, `drop-slot`).
#[derive(Clone, Copy, Debug)]
pub struct MappingReach;
/// Everything (`run`, `config`).
#[derive(Clone, Copy, Debug)]
pub struct RunReach;

impl Reach for ConnectionReach {
    const SCOPE: Scope = Scope::Connection;
}
impl Reach for MappingReach {
    const SCOPE: Scope = Scope::Mapping;
}
impl Reach for RunReach {
    const SCOPE: Scope = Scope::Run;
}

/// Flags of `migrate`.
pub type ConnectionFlags = Flags<ConnectionReach>;
/// Flags of `init-slot`, `status`, `drop-slot`.
pub type MappingFlags = Flags<MappingReach>;
/// Flags of `run` and `config`.
pub type RunFlags = Flags<RunReach>;

const CONFIG: &str = "config";

impl<R: Reach> Flags<R> {
    /// Loads the configuration: these flags over the process environment
    /// over the file over the defaults.
    pub fn load(&self) -> Result<Config, ConfigError> {
        Config::load(Sources {
            file: self.config.as_deref(),
            env: std::env::vars().collect(),
            flags: self
                .given
                .iter()
                .map(|(k, v)| (*k, v.iter().map(String::as_str).collect()))
                .collect(),
        })
    }
}

impl<R: Reach> FromArgMatches for Flags<R> {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut flags = Flags {
            config: None,
            given: Vec::new(),
            _reach: PhantomData,
        };
        flags.update_from_arg_matches(matches)?;
        Ok(flags)
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        if let Some(path) = matches.get_one::<PathBuf>(CONFIG) {
            self.config = Some(path.clone());
        }
        for s in SETTINGS.iter().filter(|s| s.scope <= R::SCOPE) {
            if let Some(values) = matches.get_many::<String>(s.key) {
                self.given.retain(|(k, _)| *k != s.key);
                self.given.push((s.key, values.cloned().collect()));
            }
        }
        Ok(())
    }
}

impl<R: Reach> Args for Flags<R> {
    fn augment_args(cmd: Command) -> Command {
        let cmd = cmd.arg(
            Arg::new(CONFIG)
                .long("config")
                .env("WALBOX_CONFIG")
                .hide_env_values(true)
                .value_name("FILE")
                .value_parser(clap::value_parser!(PathBuf))
                .help("TOML configuration file (see docs/configuration.md)"),
        );
        // Grouped under their headings, in the table's order of headings
        // (clap lists a heading where its first flag is).
        let mut headings: Vec<&str> = Vec::new();
        for s in SETTINGS.iter().filter(|s| s.scope <= R::SCOPE) {
            if !headings.contains(&s.heading()) {
                headings.push(s.heading());
            }
        }
        let running = super::table::RUNNING;
        headings.retain(|h| *h != running);
        headings.push(running);
        headings
            .into_iter()
            .flat_map(|h| {
                SETTINGS
                    .iter()
                    .filter(move |s| s.scope <= R::SCOPE && s.heading() == h)
            })
            .fold(cmd, |cmd, s| {
                let mut help = s.doc.to_owned();
                if s.default != "—" {
                    help.push_str(&format!(" [default: {}]", s.default));
                }
                help.push_str(&format!(" [env: {}]", s.env()));
                let arg = Arg::new(s.key)
                    .long(s.flag())
                    .help(help)
                    .help_heading(s.heading())
                    .action(match s.kind {
                        Kind::Map => ArgAction::Append,
                        _ => ArgAction::Set,
                    })
                    .value_name(match s.kind {
                        Kind::Map if s.key == "mapping.header_columns" => "COLUMN=HEADER",
                        Kind::Map => "KEY=VALUE",
                        Kind::Number => "N",
                        Kind::Bool => "true|false",
                        _ => "VALUE",
                    });
                let arg = match s.kind {
                    Kind::Choice(words) => arg.value_parser(words.to_vec()),
                    Kind::Bool => arg.value_parser(["true", "false"]),
                    _ => arg,
                };
                cmd.arg(arg)
            })
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}
