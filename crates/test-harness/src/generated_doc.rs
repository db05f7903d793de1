//! The generated part of a document (docs/correctness.md's torture table,
//! docs/benchmarks.md's figures): replaced between its two markers, the
//! rest of the document kept as written.

/// Replaces what lies between `start` and `end` in the file at `path`
/// with `text` (the markers stay).
pub fn replace_between(path: &str, start: &str, end: &str, text: &str) -> Result<(), String> {
    let doc = std::fs::read_to_string(path).map_err(|e| format!("read {path}: {e}"))?;
    let (Some(a), Some(b)) = (doc.find(start), doc.find(end)) else {
        return Err(format!("{path} lacks the {start} … {end} markers"));
    };
    let out = format!("{}{start}\n{text}\n{}", &doc[..a], &doc[b..]);
    std::fs::write(path, out).map_err(|e| format!("write {path}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_rest_and_the_markers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("doc.md");
        let path = path.to_str().unwrap();
        std::fs::write(path, "intro\n<!-- a -->\nold\n<!-- b -->\nafter\n").unwrap();
        replace_between(path, "<!-- a -->", "<!-- b -->", "new").unwrap();
        assert_eq!(
            std::fs::read_to_string(path).unwrap(),
            "intro\n<!-- a -->\nnew\n<!-- b -->\nafter\n"
        );
        let err = replace_between(path, "<!-- x -->", "<!-- b -->", "new").unwrap_err();
        assert!(err.contains("lacks the <!-- x -->"), "{err}");
    }
}
