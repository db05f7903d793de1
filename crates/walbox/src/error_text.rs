//! An error as one line of text: what logs, dead-letter headers and the
//! CLI print. A leaf module, so that any module may use it.

/// `e` and its causes, each said once, joined by `: ` (the OS's reason
/// included: "connect to Postgres at db:5432: Connection refused (os error
/// 111)"). Postgres's HINT and DETAIL lines become `; `-separated parts.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut line = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = cause.source();
    }
    one_line(&line)
}

/// `text` on one line: its lines trimmed and joined by `; `, blank ones
/// dropped.
pub fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// `text` cut to at most `max` bytes (on a character boundary), with `…`
/// when cut: a message that quotes a whole value stays a readable header
/// and log line.
pub fn at_most(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_text_is_cut_on_a_character_boundary() {
        assert_eq!(at_most("abc".into(), 3), "abc");
        assert_eq!(at_most("abcd".into(), 3), "abc…");
        assert_eq!(at_most("aé".into(), 2), "a…");
    }
}
