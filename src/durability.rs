//! The start-up check of a Redis store: will an acknowledged callback survive? Two settings
//! decide it. Without AOF a restart forgets it; with an eviction policy a full Redis drops
//! dedupe claims and payment states, so a duplicate is delivered again or a refund refused.
//! `store.require_durable = true` refuses anything it cannot confirm; otherwise each doubt is
//! a warning.
//!
//! With `store.min_replicas_acked = N > 0` a third question: are N replicas connected? Fewer
//! is refused whatever `require_durable` says, because every write would wait for replicas
//! that are not there and be answered 503, the layout stamp at start-up first: a clear refusal
//! naming the setting beats a process that serves only 503s, and a supervisor that restarts it
//! gets a working process once the replicas are back. A count Redis does not tell (INFO
//! disabled) is a warning: each write's `WAIT` still decides.

use crate::store::StoreError;
use crate::store::redis::{DurabilitySettings, RedisStore};

/// Why a Redis was refused (`store.require_durable = true`), or the doubts to log otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Refuse(String),
    Start { warnings: Vec<String> },
}

/// Reads the settings of `store`'s Redis (every master of a cluster) and judges them.
pub async fn check_redis(store: &RedisStore, require_durable: bool) -> Result<Verdict, StoreError> {
    Ok(worst(store.durability_settings().await?.into_iter().map(
        |(primary, settings)| (primary, judge(settings.as_ref(), require_durable)),
    )))
}

/// One verdict for the verdicts of several primaries (a cluster's masters, by name): a
/// refusal when any refuses, else every warning. Alike verdicts are said once; else each
/// message names its primary.
pub fn worst(verdicts: impl IntoIterator<Item = (Option<String>, Verdict)>) -> Verdict {
    let verdicts: Vec<(Option<String>, Verdict)> = verdicts.into_iter().collect();
    let alike = verdicts.windows(2).all(|pair| pair[0].1 == pair[1].1);
    if alike {
        if let Some((_, verdict)) = verdicts.into_iter().next() {
            return verdict;
        }
        return Verdict::Start {
            warnings: Vec::new(),
        };
    }
    let named = |primary: &Option<String>, message: &str| match primary {
        Some(name) => format!("primary {name}: {message}"),
        None => message.to_string(),
    };
    let refusals: Vec<String> = verdicts
        .iter()
        .filter_map(|(primary, verdict)| match verdict {
            Verdict::Refuse(why) => Some(named(primary, why)),
            Verdict::Start { .. } => None,
        })
        .collect();
    if !refusals.is_empty() {
        return Verdict::Refuse(refusals.join("; "));
    }
    Verdict::Start {
        warnings: verdicts
            .iter()
            .flat_map(|(primary, verdict)| match verdict {
                Verdict::Start { warnings } => warnings
                    .iter()
                    .map(|w| named(primary, w))
                    .collect::<Vec<_>>(),
                Verdict::Refuse(_) => Vec::new(),
            })
            .collect(),
    }
}

/// Reads how many replicas `store`'s Redis has connected (the fewest of any master of a
/// cluster) and judges them against `wanted` (`store.min_replicas_acked`); nothing is read
/// when `wanted` is 0.
pub async fn check_replicas(store: &RedisStore, wanted: u32) -> Result<Verdict, StoreError> {
    if wanted == 0 {
        return Ok(Verdict::Start {
            warnings: Vec::new(),
        });
    }
    Ok(judge_replicas(store.connected_replicas().await?, wanted))
}

/// Judges `connected_slaves` of `INFO replication` (`None`: INFO did not say) against
/// `wanted` replicas.
pub fn judge_replicas(connected: Option<u32>, wanted: u32) -> Verdict {
    match connected {
        _ if wanted == 0 => Verdict::Start {
            warnings: Vec::new(),
        },
        Some(n) if n < wanted => Verdict::Refuse(format!(
            "store.min_replicas_acked = {wanted} but Redis has {n} replica(s) connected \
             (INFO replication, connected_slaves; on a cluster, the master with the fewest): \
             every write would be answered 503. Connect \
             the replicas, or lower store.min_replicas_acked"
        )),
        Some(_) => Verdict::Start {
            warnings: Vec::new(),
        },
        None => Verdict::Start {
            warnings: vec![format!(
                "cannot read how many replicas Redis has connected (INFO replication is \
                 disabled, renamed or not permitted): with store.min_replicas_acked = {wanted} \
                 a write is answered 503 until {wanted} replica(s) acknowledge it"
            )],
        },
    }
}

/// Judges settings read with `CONFIG GET` (`None`: CONFIG is not available).
pub fn judge(settings: Option<&DurabilitySettings>, require_durable: bool) -> Verdict {
    let unknown = DurabilitySettings::default();
    let s = settings.unwrap_or(&unknown);
    let mut doubts = Vec::new();
    match s.appendonly.as_deref() {
        Some("yes") => {}
        Some(other) => doubts.push(format!(
            "Redis has no AOF (appendonly {other}): acknowledged callbacks are lost if Redis \
             restarts. Enable it with appendonly yes"
        )),
        None => {}
    }
    match s.maxmemory_policy.as_deref() {
        Some("noeviction") => {}
        Some(policy) => doubts.push(format!(
            "Redis maxmemory-policy is {policy}: once Redis reaches maxmemory it evicts keys, \
             dedupe claims and payment states among them, so a duplicate callback is delivered \
             again and valid transitions are refused. Set maxmemory-policy noeviction (a full \
             Redis then refuses writes, which callbackd answers with 503 and Retry-After)"
        )),
        None => {}
    }
    if s.appendonly.is_none() || s.maxmemory_policy.is_none() {
        doubts.push(
            "cannot read Redis' appendonly and maxmemory-policy (CONFIG GET is disabled, \
             renamed or not permitted): check with your Redis provider that AOF is on \
             (appendonly yes) and maxmemory-policy is noeviction, then allow CONFIG GET for \
             callbackd's user"
                .to_string(),
        );
    }
    if require_durable && !doubts.is_empty() {
        return Verdict::Refuse(format!(
            "{}; or set store.require_durable = false to start anyway",
            doubts.join("; ")
        ));
    }
    let mut warnings = doubts;
    if !warnings.is_empty() {
        warnings.push("set store.require_durable = true to refuse to start like this".into());
    }
    // Not a reason to refuse: AOF is on and survives a process crash, but `no` leaves the
    // flush to the OS (often 30 s), so a machine crash can lose acknowledged callbacks.
    if s.appendonly.as_deref() == Some("yes") && s.appendfsync.as_deref() == Some("no") {
        warnings.push(
            "Redis appendfsync is no: the OS decides when the AOF reaches the disk, so a \
             machine crash can lose acknowledged callbacks. Use appendfsync everysec, or \
             always to survive power loss"
                .to_string(),
        );
    }
    Verdict::Start { warnings }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(appendonly: &str, appendfsync: &str, policy: &str) -> DurabilitySettings {
        DurabilitySettings {
            appendonly: Some(appendonly.into()),
            appendfsync: Some(appendfsync.into()),
            maxmemory_policy: Some(policy.into()),
        }
    }

    fn refusal(verdict: Verdict) -> String {
        match verdict {
            Verdict::Refuse(m) => m,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    fn warnings(verdict: Verdict) -> Vec<String> {
        match verdict {
            Verdict::Start { warnings } => warnings,
            other => panic!("expected a start, got {other:?}"),
        }
    }

    #[test]
    fn aof_always_and_noeviction_start_without_a_word() {
        for durable in [true, false] {
            let s = settings("yes", "always", "noeviction");
            assert_eq!(warnings(judge(Some(&s), durable)), Vec::<String>::new());
        }
    }

    #[test]
    fn a_durable_config_refuses_what_it_cannot_confirm() {
        let cases = [
            (Some(settings("no", "always", "noeviction")), "appendonly"),
            (
                Some(settings("yes", "always", "allkeys-lru")),
                "maxmemory-policy",
            ),
            (
                Some(settings("yes", "always", "volatile-ttl")),
                "volatile-ttl",
            ),
            (None, "CONFIG GET"),
            (
                Some(DurabilitySettings {
                    maxmemory_policy: None,
                    ..settings("yes", "always", "")
                }),
                "cannot read",
            ),
        ];
        for (s, says) in cases {
            let message = refusal(judge(s.as_ref(), true));
            assert!(message.contains(says), "{s:?}: `{message}` lacks {says}");
            assert!(
                message.contains("store.require_durable = false"),
                "{message}"
            );
        }
    }

    #[test]
    fn otherwise_each_doubt_is_a_warning() {
        let w = warnings(judge(
            Some(&settings("yes", "always", "allkeys-lru")),
            false,
        ));
        assert!(w[0].contains("allkeys-lru"), "{w:?}");
        assert!(
            w.iter().any(|m| m.contains("require_durable = true")),
            "{w:?}"
        );
        let w = warnings(judge(None, false));
        assert!(w[0].contains("cannot read"), "{w:?}");
    }

    #[test]
    fn too_few_connected_replicas_are_refused() {
        for (connected, wanted) in [(0, 1), (1, 2), (2, 16)] {
            let message = refusal(judge_replicas(Some(connected), wanted));
            assert!(
                message.contains(&format!("store.min_replicas_acked = {wanted}")),
                "{message}"
            );
            assert!(
                message.contains(&format!("{connected} replica(s) connected")),
                "{message}"
            );
        }
    }

    #[test]
    fn enough_replicas_or_none_wanted_start_without_a_word() {
        for (connected, wanted) in [(Some(1), 1), (Some(3), 2), (Some(0), 0), (None, 0)] {
            assert_eq!(
                warnings(judge_replicas(connected, wanted)),
                Vec::<String>::new()
            );
        }
    }

    #[test]
    fn an_unknown_replica_count_is_a_warning() {
        let w = warnings(judge_replicas(None, 2));
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("INFO replication") && w[0].contains("min_replicas_acked = 2"),
            "{w:?}"
        );
    }

    #[test]
    fn appendfsync_no_is_a_warning_even_when_durability_is_required() {
        for durable in [true, false] {
            let w = warnings(judge(Some(&settings("yes", "no", "noeviction")), durable));
            assert_eq!(w.len(), 1, "{w:?}");
            assert!(w[0].contains("appendfsync"), "{w:?}");
        }
    }

    #[test]
    fn alike_masters_are_judged_once_without_names() {
        let w = warnings(worst([
            (
                Some("10.0.0.1:6379".to_string()),
                judge(Some(&settings("no", "always", "noeviction")), false),
            ),
            (
                Some("10.0.0.2:6379".to_string()),
                judge(Some(&settings("no", "always", "noeviction")), false),
            ),
        ]));
        assert!(w[0].starts_with("Redis has no AOF"), "{w:?}");
        assert!(!w.iter().any(|m| m.contains("10.0.0.")), "{w:?}");
    }

    #[test]
    fn one_refusing_master_refuses_and_is_named() {
        let why = refusal(worst([
            (
                Some("10.0.0.1:6379".to_string()),
                judge(Some(&settings("yes", "always", "noeviction")), true),
            ),
            (
                Some("10.0.0.2:6379".to_string()),
                judge(Some(&settings("yes", "always", "allkeys-lru")), true),
            ),
        ]));
        assert!(why.starts_with("primary 10.0.0.2:6379: "), "{why}");
        assert!(!why.contains("10.0.0.1"), "{why}");
    }

    #[test]
    fn differing_warnings_name_their_master() {
        let w = warnings(worst([
            (
                Some("10.0.0.1:6379".to_string()),
                judge(Some(&settings("yes", "no", "noeviction")), false),
            ),
            (
                Some("10.0.0.2:6379".to_string()),
                judge(Some(&settings("yes", "always", "noeviction")), false),
            ),
        ]));
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("primary 10.0.0.1:6379: "), "{w:?}");
        assert!(w[0].contains("appendfsync is no"), "{w:?}");
    }
}
