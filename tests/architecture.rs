//! The map matches the territory: docs/architecture.md's table of rooms and floors is read, and
//! every file under src/ is checked against it — each room exists in the table and each table
//! row in src/, a room imports only rooms on lower floors, and a pure room names no clock and
//! no global random source. Unit-test modules (`#[cfg(test)]`, `tests.rs`) are not checked.
//! The same for the router's inner files against the page's "Inside the router" table: each
//! file (a folder counts as one) imports only files on lower floors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
struct Room {
    floor: u32,
    pure: bool,
}

/// The heading of the router's own table.
const INSIDE_ROUTER: &str = "## Inside the router";

/// The table's rows: `| floor | `room` | yes/no | job |` (above the router's own table).
fn read_table(doc: &str) -> Result<BTreeMap<String, Room>, String> {
    let doc = doc.split(INSIDE_ROUTER).next().unwrap_or(doc);
    let mut rooms = BTreeMap::new();
    for (i, line) in doc.lines().enumerate() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 5 || cells[1].parse::<u32>().is_err() {
            continue;
        }
        let name = cells[2].trim_matches('`').to_string();
        let pure = match cells[3] {
            "yes" => true,
            "no" => false,
            x => return Err(format!("line {}: pure must be yes or no, not {x}", i + 1)),
        };
        let room = Room {
            floor: cells[1].parse().unwrap(),
            pure,
        };
        if rooms.insert(name.clone(), room).is_some() {
            return Err(format!("line {}: room {name} listed twice", i + 1));
        }
    }
    Ok(rooms)
}

/// Rust files under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

/// The room of a file under `src` (`src/plan/lpt.rs` → `plan`, `src/rng.rs` → `rng`), and its
/// module path below the crate root.
fn room_of(src: &Path, f: &Path) -> (String, Vec<String>) {
    let rel = f.strip_prefix(src).unwrap();
    let mut parts: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.last().is_some_and(|l| l == "mod") {
        parts.pop();
    }
    (parts[0].clone(), parts)
}

/// Words a pure room must not contain outside comments: clocks and global random sources.
const IMPURE: [&str; 8] = [
    "Instant::now",
    "SystemTime",
    "unix_now_s",
    "thread_rng",
    "rand::random",
    "OsRng",
    "from_entropy",
    "tokio::",
];

/// Every breach of the table by the files under `src`, as `file:line: what`.
fn violations(src: &Path, rooms: &BTreeMap<String, Room>) -> Vec<String> {
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for f in rust_files(src) {
        let (room, module) = room_of(src, &f);
        if room == "lib" {
            continue;
        }
        seen.insert(room.clone());
        let Some(me) = rooms.get(&room) else {
            out.push(format!(
                "{}: room `{room}` is not in docs/architecture.md's table",
                f.display()
            ));
            continue;
        };
        if f.file_name().is_some_and(|n| n == "tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        // Inside a `#[cfg(test)]` item: its brace depth once it opened.
        let mut test_item: Option<(i64, bool)> = None;
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if code.trim_start().starts_with("#[cfg(test)]") {
                test_item = Some((0, false));
                continue;
            }
            if let Some((depth, opened)) = test_item.as_mut() {
                *depth += code.matches('{').count() as i64 - code.matches('}').count() as i64;
                *opened |= code.contains('{');
                if (*opened && *depth <= 0) || (!*opened && code.contains(';')) {
                    test_item = None;
                }
                continue;
            }
            let at = || format!("{}:{}", f.display(), i + 1);
            for target in imported_rooms(code, &module) {
                if target == room || !rooms.contains_key(&target) {
                    continue;
                }
                let them = &rooms[&target];
                if them.floor >= me.floor {
                    out.push(format!(
                        "{}: `{room}` (floor {}) imports `{target}` (floor {}): imports run down only",
                        at(),
                        me.floor,
                        them.floor
                    ));
                }
            }
            if me.pure {
                for w in IMPURE {
                    if code.contains(w) {
                        out.push(format!(
                            "{}: pure room `{room}` uses `{w}` (a clock or a global random source)",
                            at()
                        ));
                    }
                }
            }
        }
    }
    for name in rooms.keys() {
        if !seen.contains(name) {
            out.push(format!(
                "docs/architecture.md lists room `{name}`, which is not in src/"
            ));
        }
    }
    out
}

/// Rooms a line of code names: `crate::ROOM` and `super::…::ROOM` paths that climb to the
/// crate root from the file's module path.
fn imported_rooms(code: &str, module: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        // `cacheroute::` or `crate::` preceded by an identifier character is another path.
        if code[..i]
            .chars()
            .last()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            continue;
        }
        out.extend(idents_after(&code[i + "crate::".len()..]));
    }
    // A file's module path (`plan/lpt` → [plan, lpt]) climbs to the root after as many
    // `super::` as it has parts.
    for (ups, tail) in super_paths(code) {
        if ups >= module.len() {
            out.extend(idents_after(tail));
        }
    }
    out
}

/// The router's table: `| floor | `file` | job |` rows under [`INSIDE_ROUTER`], up to the
/// next heading.
fn read_router_table(doc: &str) -> Result<BTreeMap<String, u32>, String> {
    let section = doc
        .split(INSIDE_ROUTER)
        .nth(1)
        .ok_or("no \"Inside the router\" section")?;
    let section = section.split("\n## ").next().unwrap_or(section);
    let mut files = BTreeMap::new();
    for line in section.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let Some(floor) = cells.get(1).and_then(|c| c.parse::<u32>().ok()) else {
            continue;
        };
        let name = cells
            .get(2)
            .ok_or("a row without a file")?
            .trim_matches('`');
        if files.insert(name.to_string(), floor).is_some() {
            return Err(format!("router file {name} listed twice"));
        }
    }
    Ok(files)
}

/// The router's inner file of `f` (`src/router/etcd/lease.rs` → `etcd`, `src/router/proxy.rs`
/// → `proxy`) and the names it imports at the router's level (`super::X` that climbs exactly
/// to `router`, `crate::router::X`), outside unit-test modules. `None` for `mod.rs`.
fn router_imports(router: &Path, f: &Path) -> Option<(String, Vec<(usize, String)>)> {
    let rel: Vec<String> = f
        .strip_prefix(router)
        .unwrap()
        .iter()
        .map(|c| c.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if rel == ["mod"] || rel.last().is_some_and(|l| l == "tests") {
        return None;
    }
    let mut module = vec!["router".to_string()];
    module.extend(rel.iter().cloned());
    if module.last().is_some_and(|l| l == "mod") {
        module.pop();
    }
    let text = std::fs::read_to_string(f).unwrap();
    let text = text
        .split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or(&text);
    let mut out = Vec::new();
    for (n, code) in statements(text) {
        let code = code.as_str();
        // `crate::router::X` is a `crate::` path to the room `router`, then X.
        for (at, _) in code.match_indices("crate::router::") {
            let before = code[..at].chars().last();
            if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
                out.extend(
                    idents_after(&code[at + "crate::router::".len()..])
                        .into_iter()
                        .map(|x| (n, x)),
                );
            }
        }
        // `super::…::X` climbing exactly to `router` from `module`: one fewer `super` than
        // parts (`crate::` paths are the crate's rooms, checked by the table above).
        for (ups, tail) in super_paths(code) {
            if ups + 1 == module.len() {
                out.extend(idents_after(tail).into_iter().map(|x| (n, x)));
            }
        }
    }
    Some((rel[0].clone(), out))
}

fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// Each `super::…` path of a line (not one inside another path): how many `super`s, and what
/// follows them.
fn super_paths(code: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("super::") {
        let before_ok = !rest[..at]
            .chars()
            .last()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
        let mut tail = &rest[at..];
        let mut ups = 0;
        while let Some(t) = tail.strip_prefix("super::") {
            ups += 1;
            tail = t;
        }
        if before_ok {
            out.push((ups, tail));
        }
        rest = tail;
    }
    out
}

/// The names a path names after a prefix: `x::…` → [x]; a group `{x, y::z, self}` → [x, y].
fn idents_after(tail: &str) -> Vec<String> {
    match tail.strip_prefix('{') {
        Some(group) => group
            .split('}')
            .next()
            .unwrap_or("")
            .split(',')
            .map(|item| ident(item.trim()))
            .filter(|n| !n.is_empty() && n != "self")
            .collect(),
        None => vec![ident(tail)],
    }
}

/// `text` with each `use …;` statement on one line (a group may span lines), each line with
/// its first line's number.
fn statements(text: &str) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    let mut open: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        match open.as_mut() {
            Some((_, acc)) => acc.push_str(code.trim()),
            None if code.trim_start().starts_with("use ")
                || code.trim_start().starts_with("pub use ")
                || code.trim_start().starts_with("pub(crate) use ") =>
            {
                open = Some((i + 1, code.to_string()))
            }
            None => {
                out.push((i + 1, code.to_string()));
                continue;
            }
        }
        if open.as_ref().is_some_and(|(_, acc)| acc.contains(';')) {
            out.extend(open.take());
        }
    }
    out.extend(open);
    out
}

/// Every breach of the router's table by the files under `router`.
fn router_violations(router: &Path, files: &BTreeMap<String, u32>) -> Vec<String> {
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for f in rust_files(router) {
        let Some((me, imports)) = router_imports(router, &f) else {
            continue;
        };
        seen.insert(me.clone());
        let Some(&mine) = files.get(&me) else {
            out.push(format!(
                "{}: router file `{me}` is not in docs/architecture.md's router table",
                f.display()
            ));
            continue;
        };
        for (line, x) in imports {
            if x == me {
                continue;
            }
            match files.get(&x) {
                Some(&theirs) if theirs >= mine => out.push(format!(
                    "{}:{line}: `{me}` (floor {mine}) imports `{x}` (floor {theirs}): imports run down only",
                    f.display()
                )),
                _ => {}
            }
        }
    }
    for name in files.keys() {
        if !seen.contains(name) {
            out.push(format!(
                "docs/architecture.md lists router file `{name}`, which is not in src/router/"
            ));
        }
    }
    out
}

#[test]
fn the_router_keeps_the_floors_of_its_table() {
    let doc = std::fs::read_to_string(root().join("docs/architecture.md")).unwrap();
    let files = read_router_table(&doc).unwrap();
    assert!(files.len() >= 15, "the table was read: {files:?}");
    let v = router_violations(&root().join("src/router"), &files);
    assert!(v.is_empty(), "{}", v.join("\n"));
}

#[test]
fn the_router_check_fails_on_an_upward_import_and_an_unlisted_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::create_dir_all(dir.join("etcd")).unwrap();
    std::fs::write(dir.join("mod.rs"), "mod state;\n").unwrap();
    std::fs::write(
        dir.join("state.rs"),
        "use super::config::C;\n#[cfg(test)]\nmod tests {\n    use super::super::control::x;\n}\n",
    )
    .unwrap();
    // A file two levels down reaching up to `control` (floor above it), and to its sibling.
    std::fs::write(
        dir.join("etcd/lease.rs"),
        "use super::client::K;\nuse super::super::{\n    config::C,\n    control::x,\n};\nfn f() { crate::router::state::g(); }\n",
    )
    .unwrap();
    std::fs::write(dir.join("stray.rs"), "fn f() {}\n").unwrap();
    let files: BTreeMap<String, u32> = [("config", 1), ("etcd", 2), ("state", 3), ("control", 4)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let v = router_violations(dir, &files);
    let has = |s: &str| v.iter().any(|x| x.contains(s));
    assert!(has("`etcd` (floor 2) imports `control` (floor 4)"), "{v:?}");
    assert!(has("`etcd` (floor 2) imports `state` (floor 3)"), "{v:?}");
    assert!(has("router file `stray` is not in"), "{v:?}");
    assert!(has("lists router file `control`, which is not"), "{v:?}");
    assert!(
        !has("`state` (floor 3) imports"),
        "a test module is not checked: {v:?}"
    );
    assert!(
        !has("imports `client`"),
        "a sibling inside a folder is the same file: {v:?}"
    );
    assert!(has("lists router file `config`, which is not"), "{v:?}");
    assert_eq!(v.len(), 5, "{v:?}");
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn the_code_keeps_the_floors_and_purity_of_docs_architecture() {
    let doc = std::fs::read_to_string(root().join("docs/architecture.md")).unwrap();
    let rooms = read_table(&doc).unwrap();
    assert!(rooms.len() >= 20, "the table was read: {rooms:?}");
    let v = violations(&root().join("src"), &rooms);
    assert!(v.is_empty(), "{}", v.join("\n"));
}

#[test]
fn the_check_fails_on_an_upward_import_an_impure_pure_room_and_a_missing_room() {
    let doc = "| floor | room | pure | job |\n| --- | --- | --- | --- |\n\
               | 0 | `rng` | yes | r |\n| 1 | `plan` | yes | p |\n| 2 | `router` | no | live |\n\
               | 3 | `ghost` | no | g |\n";
    let rooms = read_table(doc).unwrap();
    let d = tempfile::tempdir().unwrap();
    let src = d.path();
    std::fs::create_dir_all(src.join("plan")).unwrap();
    std::fs::create_dir_all(src.join("router")).unwrap();
    std::fs::write(src.join("lib.rs"), "pub mod plan;\n").unwrap();
    std::fs::write(src.join("rng.rs"), "pub fn f() {}\n").unwrap();
    // Upward: plan (1) names router (2), once by `crate::`, once by `super::super::`; a clock.
    std::fs::write(
        src.join("plan/lpt.rs"),
        "use crate::rng::f;\nuse crate::router::x;\nfn g() { super::super::router::y(); }\n\
         fn h() { let t = std::time::Instant::now(); }\n// crate::router in a comment\n\
         #[cfg(test)]\nmod tests {\n    use crate::router::z;\n}\nfn k() { crate::unix_now_s(); }\n",
    )
    .unwrap();
    std::fs::write(src.join("plan/mod.rs"), "pub mod lpt;\n").unwrap();
    std::fs::write(src.join("router/mod.rs"), "use crate::plan::X;\n").unwrap();
    std::fs::write(src.join("stray.rs"), "\n").unwrap();
    let v = violations(src, &rooms);
    let has = |s: &str| v.iter().any(|l| l.contains(s));
    assert!(has("lpt.rs:2: `plan` (floor 1) imports `router`"), "{v:#?}");
    assert!(has("lpt.rs:3: `plan` (floor 1) imports `router`"), "{v:#?}");
    assert!(
        has("lpt.rs:4: pure room `plan` uses `Instant::now`"),
        "{v:#?}"
    );
    assert!(
        has("lpt.rs:10: pure room `plan` uses `unix_now_s`"),
        "{v:#?}"
    );
    assert!(has("room `stray` is not in"), "{v:#?}");
    assert!(has("lists room `ghost`"), "{v:#?}");
    // Nothing else: the comment, the test module and the downward imports pass.
    assert_eq!(v.len(), 6, "{v:#?}");
}

/// The lints of the router's no-panic rule (docs/router.md, "No panic on input").
const NO_PANIC_LINTS: [&str; 7] = [
    "clippy::unwrap_used",
    "clippy::expect_used",
    "clippy::panic",
    "clippy::indexing_slicing",
    "clippy::unreachable",
    "clippy::todo",
    "clippy::unimplemented",
];

/// The sites in `src/router/` allowed to break the rule, each `file: the allow line`; empty
/// today. Adding one means adding it here too, with its reason in the attribute.
const ALLOWED_PANIC_SITES: [&str; 0] = [];

/// What is wrong with the no-panic rule as `router_mod` (src/router/mod.rs), `clippy_toml`
/// and the router's files (`(path, text)`) hold it: the deny missing a lint, an allowance
/// beyond tests, an allow of a rule lint without a reason or not in `allowed`.
fn no_panic_rule_problems(
    router_mod: &str,
    clippy_toml: &str,
    files: &[(String, String)],
    allowed: &[&str],
) -> Vec<String> {
    let mut v = Vec::new();
    let deny = router_mod
        .find("#![deny(")
        .map(|i| &router_mod[i..i + router_mod[i..].find(")]").unwrap_or(0)]);
    for lint in NO_PANIC_LINTS {
        if !deny.is_some_and(|d| d.contains(lint)) {
            v.push(format!("src/router/mod.rs does not deny {lint}"));
        }
    }
    for line in clippy_toml.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let tests_only = line.starts_with("allow-") && line.contains("-in-tests");
        if !tests_only {
            v.push(format!(
                "clippy.toml: `{line}` is more than an allowance in tests"
            ));
        }
    }
    for (path, text) in files {
        for l in text.lines() {
            let t = l.trim();
            let allows_rule_lint = (t.starts_with("#[allow(") || t.starts_with("#![allow("))
                && NO_PANIC_LINTS.iter().any(|x| t.contains(x));
            if !allows_rule_lint {
                continue;
            }
            let site = format!("{path}: {t}");
            if !t.contains("reason = \"") {
                v.push(format!("{site}: an allowance without a reason"));
            }
            if !allowed.contains(&site.as_str()) {
                v.push(format!("{site}: not in ALLOWED_PANIC_SITES"));
            }
        }
    }
    v
}

#[test]
fn the_router_denies_unwrap_expect_indexing_and_panics_outside_tests() {
    let src = root().join("src");
    let files: Vec<(String, String)> = rust_files(&src.join("router"))
        .into_iter()
        .map(|f| {
            let rel = f.strip_prefix(root()).unwrap().display().to_string();
            (rel, std::fs::read_to_string(&f).unwrap())
        })
        .collect();
    let router_mod = std::fs::read_to_string(src.join("router/mod.rs")).unwrap();
    let toml = std::fs::read_to_string(root().join("clippy.toml")).unwrap();
    let v = no_panic_rule_problems(&router_mod, &toml, &files, &ALLOWED_PANIC_SITES);
    assert!(v.is_empty(), "{}", v.join("\n"));
}

#[test]
fn the_no_panic_check_fails_on_a_dropped_lint_a_wide_allowance_and_an_unlisted_site() {
    let router_mod = "//! x\n#![deny(clippy::unwrap_used, clippy::panic)]\nmod a;\n";
    let toml = "allow-unwrap-in-tests = true\navoid-breaking-exported-api = false\n";
    let files = vec![(
        "src/router/a.rs".to_string(),
        "#[allow(clippy::indexing_slicing)]\nfn f() {}\n\
         #[allow(clippy::expect_used, reason = \"a\")]\nfn g() {}\n\
         #[allow(clippy::too_many_lines)]\nfn h() {}\n"
            .to_string(),
    )];
    let listed = ["src/router/a.rs: #[allow(clippy::expect_used, reason = \"a\")]"];
    let v = no_panic_rule_problems(router_mod, toml, &files, &listed);
    let has = |s: &str| v.iter().any(|l| l.contains(s));
    assert!(has("does not deny clippy::expect_used"), "{v:#?}");
    assert!(has("does not deny clippy::indexing_slicing"), "{v:#?}");
    assert!(
        has("`avoid-breaking-exported-api = false` is more than"),
        "{v:#?}"
    );
    assert!(
        has("indexing_slicing)]: an allowance without a reason"),
        "{v:#?}"
    );
    assert!(
        has("indexing_slicing)]: not in ALLOWED_PANIC_SITES"),
        "{v:#?}"
    );
    // 5 lints undenied, the setting, and the unlisted site's two; the listed one and the
    // unrelated allow pass.
    assert_eq!(v.len(), 8, "{v:#?}");
}
