//! Secret files as walbox accepts them: readable by their owner only.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Makes `path` readable and writable by its owner only (0600).
pub fn owner_only(path: &Path) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .unwrap_or_else(|e| panic!("chmod 0600 {}: {e}", path.display()));
}

/// Writes `contents` to `path` as a mounted secret is: 0600.
pub fn write(path: &Path, contents: impl AsRef<[u8]>) {
    std::fs::write(path, contents).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    owner_only(path);
}
