//! The files a configuration names: checked when it is loaded, so that
//! `walbox config` refuses what `walbox run` would fail on later, and so
//! that a secret file others can read is refused (as libpq refuses such a
//! key) instead of used.

use std::path::Path;

use super::ConfigError;

/// `path` (named by `what`) exists and can be opened: a certificate, a CA
/// bundle (a file or a directory, as `ssl.ca.location` allows).
pub(super) fn readable(what: &str, path: &Path) -> Result<(), ConfigError> {
    let meta = std::fs::metadata(path)
        .map_err(|e| ConfigError(format!("{what}: cannot read {}: {e}", path.display())))?;
    if meta.is_file() {
        std::fs::File::open(path)
            .map_err(|e| ConfigError(format!("{what}: cannot read {}: {e}", path.display())))?;
    }
    Ok(())
}

/// [`readable`], and not readable by others: a private key or a secret.
/// The owner and the group may read it (Kubernetes gives a Secret's files
/// to the pod's `fsGroup`, 0440); anyone else may not.
pub(super) fn private(what: &str, path: &Path) -> Result<(), ConfigError> {
    readable(what, path)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path)
            .map_err(|e| ConfigError(format!("{what}: cannot read {}: {e}", path.display())))?
            .permissions()
            .mode();
        if mode & 0o007 != 0 {
            return Err(ConfigError(format!(
                "{what}: {} is readable by others (mode {:o}); a secret must not be: chmod 0600 it (Kubernetes: the volume's defaultMode 0400)",
                path.display(),
                mode & 0o777
            )));
        }
    }
    Ok(())
}

/// The librdkafka properties that name files, with whether each is private.
fn kafka_file(key: &str) -> Option<bool> {
    match key {
        "ssl.key.location" | "ssl.keystore.location" => Some(true),
        k if k.ends_with(".location") => Some(false),
        "sasl.kerberos.keytab" => Some(true),
        _ => None,
    }
}

/// The files `kafka.properties` names.
pub(super) fn check_kafka<'a>(
    properties: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Result<(), ConfigError> {
    for (key, value) in properties {
        // `probe`: librdkafka looks for the system's CA bundle itself.
        if value.is_empty() || (key == "ssl.ca.location" && value == "probe") {
            continue;
        }
        let what = format!("kafka.properties.{key}");
        match kafka_file(key) {
            Some(true) => private(&what, Path::new(value))?,
            Some(false) => readable(&what, Path::new(value))?,
            None => {}
        }
    }
    Ok(())
}

/// The files `pg_url` (or libpq's variables) names.
pub(super) fn check_pg(pg: &slot_manager::PgConfig) -> Result<(), ConfigError> {
    // `system`: the operating system's trust store, no file of ours.
    if let Some(root) = pg.ssl_root_cert().filter(|r| *r != Path::new("system")) {
        readable("pg_url sslrootcert", root)?;
    }
    if let Some((cert, key)) = pg.ssl_client_cert() {
        readable("pg_url sslcert", cert)?;
        private("pg_url sslkey", key)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn with_mode(dir: &Path, name: &str, mode: u32) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, "x").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn secrets_others_can_read_are_refused() {
        let d = tempfile::tempdir().unwrap();
        for mode in [0o600, 0o400, 0o440, 0o640] {
            private("k", &with_mode(d.path(), "ok", mode)).unwrap();
        }
        for mode in [0o644, 0o604, 0o444] {
            let e = private("k", &with_mode(d.path(), "open", mode)).unwrap_err();
            assert!(e.0.contains("readable by others"), "{e}");
        }
        let e = readable("ssl.ca.location", &d.path().join("missing.pem")).unwrap_err();
        assert!(e.0.starts_with("ssl.ca.location: cannot read "), "{e}");
    }

    #[test]
    fn kafka_files_are_checked_by_kind() {
        let d = tempfile::tempdir().unwrap();
        let ca = with_mode(d.path(), "ca.pem", 0o644);
        let key = with_mode(d.path(), "client.key", 0o644);
        let props = |pairs: &[(&str, &Path)]| -> std::collections::BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.display().to_string()))
                .collect()
        };
        check_kafka(&props(&[
            ("ssl.ca.location", &ca),
            ("linger.ms", Path::new("5")),
        ]))
        .unwrap();
        let e = check_kafka(&props(&[("ssl.key.location", &key)])).unwrap_err();
        assert!(
            e.0.starts_with("kafka.properties.ssl.key.location: "),
            "{e}"
        );
        let e = check_kafka(&props(&[(
            "ssl.certificate.location",
            &d.path().join("nope"),
        )]))
        .unwrap_err();
        assert!(e.0.contains("cannot read"), "{e}");
        let probe = [("ssl.ca.location".to_owned(), "probe".to_owned())];
        check_kafka(probe.iter().map(|(k, v)| (k, v))).unwrap();
    }
}
