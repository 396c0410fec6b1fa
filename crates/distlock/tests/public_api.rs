//! The facade's public API, listed from the sources and compared with `tests/public-api.txt`, so the
//! surface does not grow (or shrink) by accident.
//!
//! `cargo public-api` would do this from rustdoc's JSON, which needs a nightly toolchain the project's
//! machines are not promised to have; this test reads the sources with `syn` instead. It starts at the
//! facade's `lib.rs` and follows every `pub` item: `pub mod`, `pub use` (into distlock-core and the
//! backend crates, through their own re-exports), and for each struct, enum, trait, function, constant
//! and type alias it lists the item, its public fields or variants, its derives, the trait impls and
//! public methods written for it anywhere in its crate. Each line carries the `cfg` it sits under, so a
//! test hook shows as `[cfg(feature = "testing")]`. Types of those crates that a listed signature names
//! but no public path reaches (`RetryPolicy::start` returns a `distlock_core::retry::Retries`) are listed
//! too, under their crate's path: users can hold one and call its methods. Methods a simple
//! `macro_rules!` of these crates expands inside an `impl` (`distlock_core::connection_builders!`) are
//! listed as expanded. What it cannot see: other items made by macros, blanket and auto-trait impls
//! (rustdoc's "Auto Trait Implementations"), and a type
//! reached only by signature whose name some module also imports from another crate (names are matched,
//! not resolved).
//!
//! The same walk, from the facade and from `distlock-sql` and the CLI's library, checks that every
//! public type and trait shows a code example in its docs (`every_public_type_has_an_example`).
//!
//! After an intended change of the API, regenerate the snapshot and review its diff:
//!
//! ```sh
//! UPDATE_PUBLIC_API=1 cargo test -p distlock --test public_api
//! git diff crates/distlock/tests/public-api.txt
//! ```

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use proc_macro2::{Delimiter, Group, Ident, Spacing, TokenStream, TokenTree};
use quote::ToTokens;
use syn::{Attribute, ImplItem, Item, TraitItem, UseTree, Visibility};

/// The crates the facade re-exports from, and the published ones it does not (`distlock-sql`,
/// reached through `connect`; the CLI's library), walked for the example check; by the name code
/// uses, with their directory.
const CRATES: &[(&str, &str)] = &[
    ("distlock", "distlock"),
    ("distlock_core", "distlock-core"),
    ("distlock_file", "distlock-file"),
    ("distlock_redis", "distlock-redis"),
    ("distlock_etcd", "distlock-etcd"),
    ("distlock_zookeeper", "distlock-zookeeper"),
    ("distlock_sql", "distlock-sql"),
    ("distlock_cli", "distlock-cli"),
];

/// One module of one crate: its items.
struct Module {
    items: Vec<Item>,
}

struct Crate {
    /// Modules by path from the crate root (`[]` is the root).
    modules: HashMap<Vec<String>, Module>,
    /// Impl blocks by the last segment of their self type (`impl X`, `impl Trait for X`).
    impls: HashMap<String, Vec<syn::ItemImpl>>,
}

fn load_crate(src: &Path) -> Crate {
    let mut krate = Crate {
        modules: HashMap::new(),
        impls: HashMap::new(),
    };
    load_module(
        &mut krate,
        Vec::new(),
        &src.join("lib.rs"),
        src.to_path_buf(),
    );
    krate
}

fn load_module(krate: &mut Crate, path: Vec<String>, file: &Path, dir: PathBuf) {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let parsed = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    add_items(krate, path, parsed.items, dir);
}

fn add_items(krate: &mut Crate, path: Vec<String>, items: Vec<Item>, dir: PathBuf) {
    for item in &items {
        match item {
            Item::Mod(m) => {
                let name = m.ident.to_string();
                let mut child = path.clone();
                child.push(name.clone());
                match &m.content {
                    Some((_, inner)) => add_items(krate, child, inner.clone(), dir.join(&name)),
                    None => {
                        let flat = dir.join(format!("{name}.rs"));
                        let file = if flat.exists() {
                            flat
                        } else {
                            dir.join(&name).join("mod.rs")
                        };
                        load_module(krate, child, &file, dir.join(&name));
                    }
                }
            }
            Item::Impl(imp) => {
                if let syn::Type::Path(tp) = &*imp.self_ty {
                    if let Some(last) = tp.path.segments.last() {
                        krate
                            .impls
                            .entry(last.ident.to_string())
                            .or_default()
                            .push(imp.clone());
                    }
                }
            }
            _ => {}
        }
    }
    krate.modules.insert(path, Module { items });
}

struct Walker {
    crates: HashMap<String, Crate>,
    lines: BTreeSet<String>,
    /// The types and traits described so far, by crate and name.
    described: BTreeSet<(String, String)>,
    /// The described types and traits whose docs show no code example, by full path.
    without_example: BTreeSet<String>,
}

/// Where a name leads: a module (to list) or an item (to describe).
enum Target {
    Module(String, Vec<String>),
    Item(String, Box<Item>),
}

fn is_pub(vis: &Visibility) -> bool {
    matches!(vis, Visibility::Public(_))
}

/// The `cfg`s an item sits under: inherited by everything listed beneath it.
fn cfg_attrs(attrs: &[Attribute]) -> Vec<String> {
    attrs
        .iter()
        .filter(|a| a.path().is_ident("cfg"))
        .map(|a| format!("[{}]", tidy(&a.meta.to_token_stream().to_string())))
        .collect()
}

/// The item's own attributes worth showing (`non_exhaustive`, `doc(hidden)`), as a prefix of its line.
fn own_attrs(attrs: &[Attribute]) -> String {
    attrs
        .iter()
        .filter(|a| {
            let p = a.path();
            p.is_ident("non_exhaustive")
                || (p.is_ident("doc") && a.to_token_stream().to_string().contains("hidden"))
        })
        .map(|a| format!("[{}] ", tidy(&a.meta.to_token_stream().to_string())))
        .collect()
}

fn derives(attrs: &[Attribute]) -> Vec<String> {
    let mut out = Vec::new();
    for a in attrs.iter().filter(|a| a.path().is_ident("derive")) {
        let _ = a.parse_nested_meta(|meta| {
            out.push(tidy(&meta.path.to_token_stream().to_string()));
            Ok(())
        });
    }
    out
}

/// proc_macro2's token spacing made readable: `fn f < T > (x : & T)` → `fn f<T>(x: &T)`.
fn tidy(tokens: &str) -> String {
    let mut s = tokens.to_string();
    for (from, to) in [
        (" :: ", "::"),
        (":: ", "::"),
        (" < ", "<"),
        ("< ", "<"),
        (" >", ">"),
        (" (", "("),
        ("( ", "("),
        (" )", ")"),
        (" ,", ","),
        (" : ", ": "),
        ("& ", "&"),
        (" ;", ";"),
        (" [", "["),
        ("[ ", "["),
        (" ]", "]"),
        ("# [", "#["),
        ("' ", "'"),
        (" ?", "?"),
        ("! ", "!"),
        (",)", ")"),
    ] {
        while s.contains(from) {
            s = s.replace(from, to);
        }
    }
    s.replace("->", " -> ")
        .replace("  ", " ")
        .replace("=>", " => ")
}

impl Walker {
    fn module(&self, krate: &str, path: &[String]) -> Option<&Module> {
        self.crates.get(krate)?.modules.get(path)
    }

    /// Resolves `segments` as written in module `(krate, at)`.
    fn resolve(&self, krate: &str, at: &[String], segments: &[String]) -> Option<Target> {
        let (first, rest) = segments.split_first()?;
        // The starting point: another crate, this crate's root, self, super, or a name in scope.
        let (mut krate, mut path): (String, Vec<String>) = match first.as_str() {
            "crate" => (krate.to_string(), Vec::new()),
            "self" => (krate.to_string(), at.to_vec()),
            "super" => (krate.to_string(), at[..at.len().saturating_sub(1)].to_vec()),
            name if self.crates.contains_key(name) => (name.to_string(), Vec::new()),
            name => {
                return self
                    .lookup(krate, at, name)
                    .and_then(|t| match (t, rest.is_empty()) {
                        (t, true) => Some(t),
                        (Target::Module(k, p), false) => self.resolve_from(&k, p, rest),
                        (Target::Item(..), false) => None,
                    })
            }
        };
        if rest.is_empty() {
            return Some(Target::Module(krate, path));
        }
        let (last, middle) = rest.split_last()?;
        for seg in middle {
            match self.lookup(&krate, &path, seg)? {
                Target::Module(k, p) => {
                    krate = k;
                    path = p;
                }
                Target::Item(..) => return None,
            }
        }
        self.lookup(&krate, &path, last)
    }

    fn resolve_from(&self, krate: &str, path: Vec<String>, rest: &[String]) -> Option<Target> {
        let mut segments = vec!["crate".to_string()];
        segments.extend(path);
        segments.extend(rest.iter().cloned());
        self.resolve(krate, &[], &segments)
    }

    /// Finds `name` in module `(krate, path)`: a child module, an item, or a `use` of that name.
    fn lookup(&self, krate: &str, path: &[String], name: &str) -> Option<Target> {
        let module = self.module(krate, path)?;
        for item in &module.items {
            match item {
                Item::Mod(m) if m.ident == name => {
                    let mut child = path.to_vec();
                    child.push(name.to_string());
                    return Some(Target::Module(krate.to_string(), child));
                }
                Item::Use(u) => {
                    let mut found = None;
                    leaves(&u.tree, &mut Vec::new(), &mut |segments, rename| {
                        if rename.as_deref() == Some(name)
                            || (rename.is_none()
                                && segments.last().map(String::as_str) == Some(name))
                        {
                            found = Some(segments.to_vec());
                        }
                    });
                    if let Some(segments) = found {
                        return self.resolve(krate, path, &segments);
                    }
                }
                other => {
                    if item_name(other).as_deref() == Some(name) {
                        return Some(Target::Item(krate.to_string(), Box::new(other.clone())));
                    }
                }
            }
        }
        None
    }

    /// Lists the public items of module `(krate, path)` under the name `shown`.
    fn walk_module(&mut self, krate: &str, path: &[String], shown: &str, cfgs: &[String]) {
        let Some(module) = self.module(krate, path) else {
            panic!("no module {krate}::{}", path.join("::"));
        };
        let items = module.items.clone();
        for item in items {
            let mut cfgs = cfgs.to_vec();
            cfgs.extend(cfg_attrs(item_attrs(&item)));
            match &item {
                Item::Mod(m) if is_pub(&m.vis) => {
                    let mut child = path.to_vec();
                    child.push(m.ident.to_string());
                    let name = format!("{shown}::{}", m.ident);
                    self.emit(&cfgs, &name, "mod");
                    self.walk_module(krate, &child, &name, &cfgs);
                }
                Item::Use(u) if is_pub(&u.vis) => {
                    let mut uses = Vec::new();
                    leaves(&u.tree, &mut Vec::new(), &mut |segments, rename| {
                        uses.push((segments.to_vec(), rename));
                    });
                    for (segments, rename) in uses {
                        self.walk_use(krate, path, shown, &cfgs, &segments, rename);
                    }
                }
                other if item_is_pub(other) => {
                    let name = format!("{shown}::{}", item_name(other).unwrap_or_default());
                    self.describe(krate, other, &name, &cfgs);
                }
                _ => {}
            }
        }
    }

    fn walk_use(
        &mut self,
        krate: &str,
        at: &[String],
        shown: &str,
        cfgs: &[String],
        segments: &[String],
        rename: Option<String>,
    ) {
        if segments.last().map(String::as_str) == Some("*") {
            let base = &segments[..segments.len() - 1];
            match self.resolve(krate, at, base) {
                Some(Target::Module(k, p)) => self.walk_module(&k, &p, shown, cfgs),
                _ => panic!("cannot resolve glob {}", segments.join("::")),
            }
            return;
        }
        let name = rename.unwrap_or_else(|| segments.last().cloned().unwrap_or_default());
        let full = format!("{shown}::{name}");
        // `pub use tokio_postgres;`: a whole external crate (a local item needs no `use` of one
        // segment), listed by path only; resolving it would find this `use` again.
        if let [only] = segments {
            if !self.crates.contains_key(only) {
                self.emit(cfgs, &full, &format!("pub use {only}"));
                return;
            }
        }
        match self.resolve(krate, at, segments) {
            Some(Target::Module(k, p)) => {
                self.emit(cfgs, &full, "mod");
                self.walk_module(&k, &p, &full, cfgs);
            }
            Some(Target::Item(k, item)) => {
                let mut cfgs = cfgs.to_vec();
                cfgs.extend(cfg_attrs(item_attrs(&item)));
                self.describe(&k, &item, &full, &cfgs);
            }
            // A re-export from a crate outside the workspace (`pub use tonic::Code`): its API is that
            // crate's, listed here by path only.
            None if segments.first().is_some_and(|first| {
                !matches!(first.as_str(), "crate" | "self" | "super")
                    && !self.crates.contains_key(first)
                    && self.lookup(krate, at, first).is_none()
            }) =>
            {
                self.emit(cfgs, &full, &format!("pub use {}", segments.join("::")));
            }
            None => panic!("cannot resolve pub use {} in {krate}", segments.join("::")),
        }
    }

    fn emit(&mut self, cfgs: &[String], path: &str, what: &str) {
        let mut cfgs = cfgs.to_vec();
        cfgs.dedup();
        let prefix = if cfgs.is_empty() {
            String::new()
        } else {
            format!("{} ", cfgs.join(" "))
        };
        self.lines.insert(format!("{path}: {prefix}{what}"));
    }

    /// The public types and traits of the re-exported crates that a listed line names (a method's
    /// return type, a field's type) but the walk did not reach by a path: users can hold one (say
    /// `RetryPolicy::start`'s `Retries`) and call its methods, so they are listed too, under the path of
    /// their crate, until nothing new is named.
    fn describe_reachable(&mut self) {
        loop {
            let named: BTreeSet<String> = self
                .lines
                .iter()
                .filter_map(|line| line.split_once(": ").map(|(_, what)| what))
                .flat_map(|what| {
                    what.split(|c: char| !(c.is_alphanumeric() || c == '_'))
                        .map(str::to_string)
                        .collect::<Vec<_>>()
                })
                .collect();
            let foreign = self.foreign_names();
            let mut found = Vec::new();
            for (krate_name, krate) in &self.crates {
                if krate_name == "distlock" {
                    continue;
                }
                for (path, module) in &krate.modules {
                    for item in &module.items {
                        let ident = match item {
                            Item::Struct(i) if is_pub(&i.vis) => i.ident.to_string(),
                            Item::Enum(i) if is_pub(&i.vis) => i.ident.to_string(),
                            Item::Trait(i) if is_pub(&i.vis) => i.ident.to_string(),
                            _ => continue,
                        };
                        let key = (krate_name.clone(), ident.clone());
                        if named.contains(&ident)
                            && !foreign.contains(&ident)
                            && !self.described.contains(&key)
                        {
                            let mut full = vec![krate_name.clone()];
                            full.extend(path.iter().cloned());
                            full.push(ident);
                            found.push((key, full.join("::"), item.clone()));
                        }
                    }
                }
            }
            if found.is_empty() {
                return;
            }
            for ((krate, _), full, item) in found {
                let cfgs = cfg_attrs(item_attrs(&item));
                self.describe(&krate, &item, &full, &cfgs);
            }
        }
    }

    /// Names some module imports from outside these crates (`use tokio::time::Instant`): a signature
    /// naming one may mean that type, so [`describe_reachable`](Self::describe_reachable) does not take
    /// it for a type of these crates of the same name (a type so named is not followed: the price of
    /// matching by name).
    fn foreign_names(&self) -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        for krate in self.crates.values() {
            for module in krate.modules.values() {
                for item in &module.items {
                    let Item::Use(u) = item else { continue };
                    leaves(&u.tree, &mut Vec::new(), &mut |segments, rename| {
                        let first = segments.first().map(String::as_str).unwrap_or_default();
                        let ours = matches!(first, "crate" | "self" | "super")
                            || self.crates.contains_key(first);
                        if !ours {
                            if let Some(name) = rename.or_else(|| segments.last().cloned()) {
                                names.insert(name);
                            }
                        }
                    });
                }
            }
        }
        names
    }

    /// One item and what hangs off it (fields, variants, trait items, impls).
    fn describe(&mut self, krate: &str, item: &Item, full: &str, cfgs: &[String]) {
        if let Some(name) = match item {
            Item::Struct(_) | Item::Enum(_) | Item::Trait(_) => item_name(item),
            _ => None,
        } {
            self.described.insert((krate.to_string(), name));
            if !has_example(item_attrs(item)) {
                self.without_example.insert(full.to_string());
            }
        }
        match item {
            Item::Struct(s) => {
                let generics = tidy(&s.generics.to_token_stream().to_string());
                let own = own_attrs(&s.attrs);
                self.emit(
                    cfgs,
                    full,
                    &format!("{own}pub struct {}{generics}", s.ident),
                );
                for d in derives(&s.attrs) {
                    self.emit(cfgs, full, &format!("derive {d}"));
                }
                for f in s.fields.iter().filter(|f| is_pub(&f.vis)) {
                    let mut c = cfgs.to_vec();
                    c.extend(cfg_attrs(&f.attrs));
                    let ty = tidy(&f.ty.to_token_stream().to_string());
                    let field = f.ident.as_ref().map_or("_".into(), |i| i.to_string());
                    let own = own_attrs(&f.attrs);
                    self.emit(&c, &format!("{full}.{field}"), &format!("{own}pub {ty}"));
                }
                self.describe_impls(krate, &s.ident.to_string(), full, cfgs);
            }
            Item::Enum(e) => {
                let own = own_attrs(&e.attrs);
                self.emit(cfgs, full, &format!("{own}pub enum {}", e.ident));
                for d in derives(&e.attrs) {
                    self.emit(cfgs, full, &format!("derive {d}"));
                }
                for v in &e.variants {
                    let mut c = cfgs.to_vec();
                    c.extend(cfg_attrs(&v.attrs));
                    let fields = fields_text(&v.fields);
                    let own = own_attrs(&v.attrs);
                    let what = format!("{own}variant {fields}");
                    self.emit(&c, &format!("{full}::{}", v.ident), what.trim_end());
                }
                self.describe_impls(krate, &e.ident.to_string(), full, cfgs);
            }
            Item::Trait(t) => self.describe_trait(t, full, cfgs),
            Item::Fn(f) => self.emit(
                cfgs,
                full,
                &format!("{}{}", own_attrs(&f.attrs), signature(&f.sig)),
            ),
            Item::Const(c) => {
                let ty = tidy(&c.ty.to_token_stream().to_string());
                self.emit(cfgs, full, &format!("pub const {}: {ty}", c.ident));
            }
            Item::Static(s) => {
                let ty = tidy(&s.ty.to_token_stream().to_string());
                self.emit(cfgs, full, &format!("pub static {}: {ty}", s.ident));
            }
            Item::Type(t) => {
                let generics = tidy(&t.generics.to_token_stream().to_string());
                let ty = tidy(&t.ty.to_token_stream().to_string());
                self.emit(
                    cfgs,
                    full,
                    &format!("pub type {}{generics} = {ty}", t.ident),
                );
            }
            other => panic!("{full}: an item of a kind this test does not describe: {other:?}"),
        }
    }

    fn describe_trait(&mut self, t: &syn::ItemTrait, full: &str, cfgs: &[String]) {
        let generics = tidy(&t.generics.to_token_stream().to_string());
        let supertraits = tidy(&t.supertraits.to_token_stream().to_string());
        self.emit(
            cfgs,
            full,
            &format!("pub trait {}{generics}: {supertraits}", t.ident),
        );
        for ti in &t.items {
            let (name, text, attrs) = match ti {
                TraitItem::Fn(f) => (f.sig.ident.to_string(), signature(&f.sig), &f.attrs),
                TraitItem::Type(ty) => {
                    let bounds = tidy(&ty.bounds.to_token_stream().to_string());
                    (
                        ty.ident.to_string(),
                        format!("type {}: {bounds}", ty.ident),
                        &ty.attrs,
                    )
                }
                TraitItem::Const(c) => (
                    c.ident.to_string(),
                    format!(
                        "const {}: {}",
                        c.ident,
                        tidy(&c.ty.to_token_stream().to_string())
                    ),
                    &c.attrs,
                ),
                _ => continue,
            };
            let mut c = cfgs.to_vec();
            c.extend(cfg_attrs(attrs));
            let own = own_attrs(attrs);
            self.emit(&c, &format!("{full}::{name}"), &format!("{own}{text}"));
        }
    }

    fn describe_impls(&mut self, krate: &str, ty: &str, full: &str, cfgs: &[String]) {
        let impls = self.crates[krate]
            .impls
            .get(ty)
            .cloned()
            .unwrap_or_default();
        for imp in impls {
            let mut c = cfgs.to_vec();
            c.extend(cfg_attrs(&imp.attrs));
            if let Some((_, trait_path, _)) = &imp.trait_ {
                let name = tidy(&trait_path.to_token_stream().to_string());
                self.emit(&c, full, &format!("impl {name}"));
                continue;
            }
            for ii in &self.expand_macros(&imp.items, 0) {
                let (name, text, attrs) = match ii {
                    ImplItem::Fn(f) if is_pub(&f.vis) => {
                        (f.sig.ident.to_string(), signature(&f.sig), &f.attrs)
                    }
                    ImplItem::Const(k) if is_pub(&k.vis) => (
                        k.ident.to_string(),
                        format!(
                            "pub const {}: {}",
                            k.ident,
                            tidy(&k.ty.to_token_stream().to_string())
                        ),
                        &k.attrs,
                    ),
                    _ => continue,
                };
                let mut c = c.clone();
                c.extend(cfg_attrs(attrs));
                let own = own_attrs(attrs);
                self.emit(&c, &format!("{full}::{name}"), &format!("{own}{text}"));
            }
        }
    }
}

/// Expanding `macro_rules!` invocations inside an `impl` (`distlock_core::connection_builders!(..)`),
/// for the simple macros these crates export: every `$name:fragment` of an arm's matcher binds one
/// token tree of the invocation, the rest of the matcher must equal it token for token.
impl Walker {
    fn expand_macros(&self, items: &[ImplItem], depth: usize) -> Vec<ImplItem> {
        assert!(depth < 8, "macro expansion too deep");
        let mut out = Vec::new();
        for item in items {
            match item {
                ImplItem::Macro(m) => {
                    let expanded = self.expand(&m.mac);
                    out.extend(self.expand_macros(&expanded, depth + 1));
                }
                other => out.push(other.clone()),
            }
        }
        out
    }

    /// The items one invocation expands to; panics on a macro it cannot find or match, so the listing
    /// never silently drops what a macro adds.
    fn expand(&self, mac: &syn::Macro) -> Vec<ImplItem> {
        let name = mac
            .path
            .segments
            .last()
            .map(|s| s.ident.to_string())
            .unwrap_or_default();
        let (krate, rules) = self
            .crates
            .iter()
            .flat_map(|(k, c)| c.modules.values().map(move |m| (k, m)))
            .flat_map(|(k, m)| m.items.iter().map(move |i| (k, i)))
            .find_map(|(k, item)| match item {
                Item::Macro(m) if m.ident.as_ref().is_some_and(|i| *i == name) => {
                    Some((k.clone(), m.mac.tokens.clone()))
                }
                _ => None,
            })
            .unwrap_or_else(|| {
                panic!("macro {name}! invoked in an impl is not defined in {CRATES:?}")
            });
        let input: Vec<TokenTree> = mac.tokens.clone().into_iter().collect();
        let rules: Vec<TokenTree> = rules.into_iter().collect();
        for arm in rules.split(|t| matches!(t, TokenTree::Punct(p) if p.as_char() == ';')) {
            let [TokenTree::Group(matcher), TokenTree::Punct(_), TokenTree::Punct(_), TokenTree::Group(body)] =
                arm
            else {
                continue;
            };
            let matcher: Vec<TokenTree> = matcher.stream().into_iter().collect();
            if let Some(bindings) = bind(&matcher, &input) {
                let body = unqualify(substitute(body.stream(), &bindings, &krate));
                let imp: syn::ItemImpl = syn::parse_str(&format!("impl Expanded {{ {body} }}"))
                    .unwrap_or_else(|e| panic!("{name}!: {e}"));
                return imp.items;
            }
        }
        panic!("no arm of {name}! matches {}", mac.tokens)
    }
}

fn bind(matcher: &[TokenTree], input: &[TokenTree]) -> Option<HashMap<String, TokenTree>> {
    let mut bindings = HashMap::new();
    let (mut m, mut i) = (0, 0);
    while m < matcher.len() {
        if let (
            TokenTree::Punct(dollar),
            Some(TokenTree::Ident(var)),
            Some(TokenTree::Punct(colon)),
        ) = (&matcher[m], matcher.get(m + 1), matcher.get(m + 2))
        {
            if dollar.as_char() == '$' && colon.as_char() == ':' {
                bindings.insert(var.to_string(), input.get(i)?.clone());
                (m, i) = (m + 4, i + 1);
                continue;
            }
        }
        if matcher[m].to_string() != input.get(i)?.to_string() {
            return None;
        }
        (m, i) = (m + 1, i + 1);
    }
    (i == input.len()).then_some(bindings)
}

/// A macro names types by full path (`::core::time::Duration`, `$crate::retry::RetryPolicy`) so that it
/// works wherever it is invoked; the listing shows them by name, as the other signatures are written.
fn unqualify(tokens: TokenStream) -> TokenStream {
    let tokens: Vec<TokenTree> = tokens.into_iter().collect();
    let colon =
        |t: Option<&TokenTree>| matches!(t, Some(TokenTree::Punct(p)) if p.as_char() == ':');
    // The first `:` of a `::` is joined to the second (`x: ::core` has a lone one first).
    let joint = |t: Option<&TokenTree>| matches!(t, Some(TokenTree::Punct(p)) if p.as_char() == ':' && p.spacing() == Spacing::Joint);
    const KEYWORDS: &[&str] = &["impl", "dyn", "self", "mut", "as", "fn", "pub", "ref"];
    let keyword = |t: &TokenTree| KEYWORDS.contains(&t.to_string().as_str());
    let module = |t: &TokenTree| match t {
        TokenTree::Ident(i) => {
            i.to_string().starts_with(|c: char| c.is_ascii_lowercase()) && !keyword(t)
        }
        _ => false,
    };
    let mut out: Vec<TokenTree> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        if module(&tokens[i]) && joint(tokens.get(i + 1)) && colon(tokens.get(i + 2)) {
            // A path's leading `::` goes too; a `::` after a name (`Self::new`) is not leading.
            let n = out.len();
            let after_name =
                n >= 3 && matches!(&out[n - 3], TokenTree::Ident(_) if !keyword(&out[n - 3]));
            let leading = n >= 2 && joint(out.get(n - 2)) && colon(out.get(n - 1)) && !after_name;
            if leading {
                out.truncate(n - 2);
            }
            i += 3;
            continue;
        }
        out.push(match &tokens[i] {
            TokenTree::Group(g) => {
                TokenTree::Group(Group::new(g.delimiter(), unqualify(g.stream())))
            }
            other => other.clone(),
        });
        i += 1;
    }
    out.into_iter().collect()
}

/// `$name` → its binding, `$crate` → the macro's crate.
fn substitute(
    body: TokenStream,
    bindings: &HashMap<String, TokenTree>,
    krate: &str,
) -> TokenStream {
    let mut out = Vec::new();
    let mut tokens = body.into_iter().peekable();
    while let Some(token) = tokens.next() {
        match token {
            TokenTree::Punct(p) if p.as_char() == '$' => match tokens.next() {
                Some(TokenTree::Ident(var)) if var == "crate" => {
                    out.push(TokenTree::Ident(Ident::new(krate, var.span())));
                }
                Some(TokenTree::Ident(var)) => out.push(
                    bindings
                        .get(&var.to_string())
                        .unwrap_or_else(|| panic!("unbound ${var}"))
                        .clone(),
                ),
                other => panic!("unexpected ${other:?}"),
            },
            TokenTree::Group(g) => {
                let inner = substitute(g.stream(), bindings, krate);
                let delimiter: Delimiter = g.delimiter();
                out.push(TokenTree::Group(Group::new(delimiter, inner)));
            }
            other => out.push(other),
        }
    }
    out.into_iter().collect()
}

fn signature(sig: &syn::Signature) -> String {
    let text = tidy(&sig.to_token_stream().to_string());
    // A `mut` binding is the body's business, not the caller's.
    format!(
        "pub {}",
        text.replace("(mut self", "(self")
            .replace(", mut ", ", ")
            .replace("(mut ", "(")
    )
}

/// A variant's fields without their doc comments: `(T)` or `{ a: T, b: U }`.
fn fields_text(fields: &syn::Fields) -> String {
    let ty = |f: &syn::Field| tidy(&f.ty.to_token_stream().to_string());
    match fields {
        syn::Fields::Unit => String::new(),
        syn::Fields::Unnamed(u) => {
            format!(
                "({})",
                u.unnamed.iter().map(ty).collect::<Vec<_>>().join(", ")
            )
        }
        syn::Fields::Named(n) => {
            let named: Vec<String> = n
                .named
                .iter()
                .map(|f| {
                    format!(
                        "{}: {}",
                        f.ident.as_ref().map_or(String::new(), |i| i.to_string()),
                        ty(f)
                    )
                })
                .collect();
            format!("{{ {} }}", named.join(", "))
        }
    }
}

fn leaves(tree: &UseTree, prefix: &mut Vec<String>, f: &mut dyn FnMut(&[String], Option<String>)) {
    match tree {
        UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            leaves(&p.tree, prefix, f);
            prefix.pop();
        }
        UseTree::Name(n) => {
            prefix.push(n.ident.to_string());
            f(prefix, None);
            prefix.pop();
        }
        UseTree::Rename(r) => {
            prefix.push(r.ident.to_string());
            f(prefix, Some(r.rename.to_string()));
            prefix.pop();
        }
        UseTree::Glob(_) => {
            prefix.push("*".into());
            f(prefix, None);
            prefix.pop();
        }
        UseTree::Group(g) => {
            for t in &g.items {
                leaves(t, prefix, f);
            }
        }
    }
}

fn item_name(item: &Item) -> Option<String> {
    Some(match item {
        Item::Struct(i) => i.ident.to_string(),
        Item::Enum(i) => i.ident.to_string(),
        Item::Trait(i) => i.ident.to_string(),
        Item::Fn(i) => i.sig.ident.to_string(),
        Item::Const(i) => i.ident.to_string(),
        Item::Static(i) => i.ident.to_string(),
        Item::Type(i) => i.ident.to_string(),
        Item::Mod(i) => i.ident.to_string(),
        _ => return None,
    })
}

fn item_is_pub(item: &Item) -> bool {
    match item {
        Item::Struct(i) => is_pub(&i.vis),
        Item::Enum(i) => is_pub(&i.vis),
        Item::Trait(i) => is_pub(&i.vis),
        Item::Fn(i) => is_pub(&i.vis),
        Item::Const(i) => is_pub(&i.vis),
        Item::Static(i) => is_pub(&i.vis),
        Item::Type(i) => is_pub(&i.vis),
        _ => false,
    }
}

fn item_attrs(item: &Item) -> &[Attribute] {
    match item {
        Item::Struct(i) => &i.attrs,
        Item::Enum(i) => &i.attrs,
        Item::Trait(i) => &i.attrs,
        Item::Fn(i) => &i.attrs,
        Item::Const(i) => &i.attrs,
        Item::Static(i) => &i.attrs,
        Item::Type(i) => &i.attrs,
        Item::Mod(i) => &i.attrs,
        Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

/// Whether the docs hold a code block: in a doc comment, or in `#[cfg_attr(doc, doc = "…")]` (docs
/// that clap must not turn into `--help` text).
fn has_example(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|a| {
        (a.path().is_ident("doc") || a.path().is_ident("cfg_attr"))
            && a.meta.to_token_stream().to_string().contains("```")
    })
}

/// Everything public from the `roots` crates down.
fn walk(roots: &[&str]) -> Walker {
    let crates_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let crates = CRATES
        .iter()
        .map(|(name, dir)| {
            (
                name.to_string(),
                load_crate(&crates_dir.join(dir).join("src")),
            )
        })
        .collect();
    let mut walker = Walker {
        crates,
        lines: BTreeSet::new(),
        described: BTreeSet::new(),
        without_example: BTreeSet::new(),
    };
    for root in roots {
        walker.walk_module(root, &[], root, &[]);
    }
    walker.describe_reachable();
    walker
}

/// The facade's API, one line per item.
fn listing() -> String {
    let walker = walk(&["distlock"]);
    let mut out = String::new();
    for line in &walker.lines {
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[test]
fn the_public_api_is_the_reviewed_one() {
    let actual = listing();
    let snapshot = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/public-api.txt");
    if std::env::var_os("UPDATE_PUBLIC_API").is_some() {
        std::fs::write(&snapshot, &actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&snapshot).unwrap_or_default();
    if actual != expected {
        let old: BTreeSet<&str> = expected.lines().collect();
        let new: BTreeSet<&str> = actual.lines().collect();
        let mut diff = String::new();
        for line in new.difference(&old) {
            diff.push_str(&format!("+ {line}\n"));
        }
        for line in old.difference(&new) {
            diff.push_str(&format!("- {line}\n"));
        }
        panic!(
            "the public API differs from tests/public-api.txt (+ new, - gone):\n{diff}\nIf the change is \
             intended: UPDATE_PUBLIC_API=1 cargo test -p distlock --test public_api, and review the diff"
        );
    }
}

/// The walk really sees what it claims to: a user type, a test hook under its cfg, and no internals.
#[test]
fn the_listing_sees_items_hooks_and_not_internals() {
    let listing = listing();
    for expected in [
        "distlock::Locks::lock: pub fn lock(&self, name: &str) -> Result<Lock>",
        "distlock::memory::MemoryBackend::freeze: [cfg(feature = \"testing\")] pub fn freeze(&self)",
        "distlock::raw::Backend: pub trait Backend: Send + Sync + 'static",
        "distlock::ErrorKind: [non_exhaustive] pub enum ErrorKind",
        "distlock::ErrorKind::Timeout: variant",
        // Made by `distlock_core::connection_builders!`.
        "distlock::redis::RedisConfig::with_password: [cfg(feature = \"redis\")] pub fn with_password(self, password: impl Into<String>) -> Self",
        // Reached only through `RetryPolicy::start`'s signature.
        "distlock_core::retry::Retries::next_delay: pub fn next_delay(&mut self) -> Option<Duration>",
    ] {
        assert!(
            listing.lines().any(|l| l == expected),
            "missing {expected:?} in:\n{listing}"
        );
    }
    for internal in [
        "distlock::clock",
        "distlock::duration",
        "distlock::url",
        "distlock::name",
        "FileAcquisition",
        "MemoryAcquisition",
    ] {
        assert!(
            !listing.contains(internal),
            "{internal:?} is public:\n{listing}"
        );
    }
}

/// Every public type and trait of the published crates shows a code example in its docs (issue 30),
/// reached from the facade and from the crates it does not re-export (`distlock-sql`, whose backends
/// `connect` builds; the CLI's library). etcd's protobuf messages, which a few signatures of its gRPC
/// client name, are generated from etcd's `.proto` files and documented there.
#[test]
fn every_public_type_has_an_example() {
    let walker = walk(&["distlock", "distlock_sql", "distlock_cli"]);
    let missing: Vec<&String> = walker
        .without_example
        .iter()
        .filter(|path| !path.contains("::generated::"))
        .collect();
    assert!(
        missing.is_empty(),
        "these public types have no code example in their docs (add a runnable one):\n{}",
        missing
            .iter()
            .map(|p| format!("  {p}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The walk reached the types, and the check tells docs with a code block from docs without.
    assert!(walker
        .described
        .contains(&("distlock_core".into(), "Locks".into())));
    assert!(walker
        .described
        .contains(&("distlock_sql".into(), "SqlConfig".into())));
    let without: syn::ItemStruct = syn::parse_quote! {
        #[doc = " A lock."]
        pub struct S;
    };
    let with: syn::ItemStruct = syn::parse_quote! {
        #[doc = " A lock."]
        #[doc = " ```"]
        #[doc = " let s = S;"]
        #[doc = " ```"]
        pub struct S;
    };
    assert!(!has_example(&without.attrs) && has_example(&with.attrs));
}
