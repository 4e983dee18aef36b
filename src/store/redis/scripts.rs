//! The Lua scripts, compiled in, and how each is called by its hash: a leaf that the engine's
//! state changes (`commands.rs`) and its transport (`connection.rs`, which loads a script
//! where a server lacks it) both use.

use redis::{Cmd, Script};

/// The scripts, compiled in. History appends, lifetimes and the state indexes are shared Lua
/// (`history.lua`, `expiry.lua`, `index.lua`), prepended to the scripts that use them.
pub(super) struct Scripts {
    pub(super) accept: LuaScript,
    pub(super) claim: LuaScript,
    /// Writes one lifecycle effect to a message (`apply.rs`).
    pub(super) apply: LuaScript,
    pub(super) sweep: LuaScript,
    /// Reads a page of ids from a partition's state indexes (`reads.rs`).
    pub(super) list: LuaScript,
    /// Writes nothing, but is flagged as a script that may: Redis refuses it exactly when it
    /// would refuse a growing write, so `ping` learns the store is full without writing.
    pub(super) full_probe: LuaScript,
}

/// A script called by its hash, with its text at hand to load it on a server that lacks it.
pub(super) struct LuaScript {
    script: Script,
    source: &'static str,
}

impl LuaScript {
    fn new(source: &'static str) -> LuaScript {
        LuaScript {
            script: Script::new(source),
            source,
        }
    }

    pub(super) fn source(&self) -> &'static str {
        self.source
    }

    pub(super) fn hash(&self) -> &str {
        self.script.get_hash()
    }

    /// `SCRIPT LOAD` of this script.
    pub(super) fn load(&self) -> Cmd {
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(self.source);
        load
    }
}

/// The first line of a script that grows memory. A script with this line is *flagged*: with
/// no `allow-oom`, a Redis at `maxmemory` refuses it whole before it runs. A script without
/// flags is checked only until its first write, and one that starts with a write Redis allows
/// at OOM (`apply.lua`'s `ZREM`) would go on to grow memory past the limit.
macro_rules! grows {
    ($($part:literal),+ $(,)?) => { concat!("#!lua\n", $(include_str!($part)),+) };
}

/// The same with the wake-up of other processes (`wake.lua`): `$wake` is the command it
/// sends, PUBLISH or SPUBLISH.
macro_rules! grows_and_wakes {
    ($wake:literal, $($part:literal),+ $(,)?) => {
        concat!(
            "#!lua\nlocal WAKE = '", $wake, "'\n",
            include_str!("lua/wake.lua"),
            $(include_str!($part)),+
        )
    };
}

impl Scripts {
    /// `cluster`: the wake-ups are sent on shard channels (`wake.rs`).
    pub(super) fn new(cluster: bool) -> Scripts {
        let (accept, apply) = if cluster {
            (
                grows_and_wakes!(
                    "SPUBLISH",
                    "lua/pieces.lua",
                    "lua/expiry.lua",
                    "lua/index.lua",
                    "lua/accept.lua"
                ),
                grows_and_wakes!(
                    "SPUBLISH",
                    "lua/pieces.lua",
                    "lua/history.lua",
                    "lua/expiry.lua",
                    "lua/index.lua",
                    "lua/apply.lua"
                ),
            )
        } else {
            (
                grows_and_wakes!(
                    "PUBLISH",
                    "lua/pieces.lua",
                    "lua/expiry.lua",
                    "lua/index.lua",
                    "lua/accept.lua"
                ),
                grows_and_wakes!(
                    "PUBLISH",
                    "lua/pieces.lua",
                    "lua/history.lua",
                    "lua/expiry.lua",
                    "lua/index.lua",
                    "lua/apply.lua"
                ),
            )
        };
        Scripts {
            accept: LuaScript::new(accept),
            claim: LuaScript::new(grows!("lua/pieces.lua", "lua/claim.lua")),
            apply: LuaScript::new(apply),
            // Only deletes: it must run at OOM too, since it is what frees memory.
            sweep: LuaScript::new(concat!(
                "#!lua flags=allow-oom\n",
                include_str!("lua/expiry.lua"),
                include_str!("lua/index.lua"),
                include_str!("lua/sweep.lua")
            )),
            // Reads only, so it runs on a full store and on a replica too.
            list: LuaScript::new(concat!(
                "#!lua flags=no-writes,allow-oom\n",
                include_str!("lua/index.lua"),
                include_str!("lua/list.lua")
            )),
            full_probe: LuaScript::new("#!lua\nreturn 1"),
        }
    }
}
