//! libpq's password file (`~/.pgpass`, or `PGPASSFILE`): lines of
//! `hostname:port:database:username:password`, `*` matching anything, `\:`
//! and `\\` escaping, `#` comments. The first matching line wins. As in
//! libpq, a file that its group or others may read is ignored (with a
//! warning): a password in it is no secret.

use std::path::Path;

/// What a line is matched against.
pub(crate) struct Target<'a> {
    /// The host name, or `localhost` for a Unix-domain socket.
    pub host: &'a str,
    pub port: u16,
    pub dbname: &'a str,
    pub user: &'a str,
}

/// The password for `target` in the file at `path`, if it has one.
pub(crate) fn lookup(path: &Path, target: &Target<'_>) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path).ok()?.permissions().mode();
        if mode & 0o077 != 0 {
            tracing::warn!(
                file = %path.display(),
                "password file ignored: its group or others may read it (chmod 0600 it)"
            );
            return None;
        }
    }
    find(&text, target)
}

/// The first line of `text` that matches `target`, its password.
fn find(text: &str, target: &Target<'_>) -> Option<String> {
    let port = target.port.to_string();
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .filter_map(fields)
        .find(|f| {
            [target.host, port.as_str(), target.dbname, target.user]
                .iter()
                .zip(f.iter())
                .all(|(want, have)| have == "*" || have == want)
        })
        .map(|mut f| f.swap_remove(4))
}

/// A line's five fields, unescaped; `None` for a line without five.
fn fields(line: &str) -> Option<Vec<String>> {
    let mut out = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(next) = chars.next() {
                    out.last_mut()?.push(next);
                }
            }
            // The password is the rest of the line, colons included.
            ':' if out.len() < 5 => out.push(String::new()),
            c => out.last_mut()?.push(c),
        }
    }
    (out.len() == 5).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target<'a>(host: &'a str, dbname: &'a str, user: &'a str) -> Target<'a> {
        Target {
            host,
            port: 5432,
            dbname,
            user,
        }
    }

    #[test]
    fn matches_the_first_fitting_line_with_wildcards_and_escapes() {
        let file = "\
# comment
db.example:5432:app:walbox:first
*:*:*:walbox:p\\:ass\\\\word:with:colons
*:*:*:*:fallback
";
        assert_eq!(
            find(file, &target("db.example", "app", "walbox")).as_deref(),
            Some("first")
        );
        assert_eq!(
            find(file, &target("other", "app", "walbox")).as_deref(),
            Some("p:ass\\word:with:colons")
        );
        assert_eq!(
            find(file, &target("other", "x", "someone")).as_deref(),
            Some("fallback")
        );
        assert_eq!(
            find("h:1:d:u:p\nbroken line\n", &target("h", "d", "u")),
            None
        );
        assert_eq!(find("", &target("h", "d", "u")), None);
    }

    #[test]
    fn a_file_others_may_read_is_ignored() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pgpass");
        std::fs::write(&path, "*:*:*:*:secret\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(lookup(&path, &target("h", "d", "u")), None);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            lookup(&path, &target("h", "d", "u")).as_deref(),
            Some("secret")
        );
    }
}
