-- Wakes the idle dispatchers of every process (src/store/redis/wake.rs) when a write makes work
-- due by `now`: one message on the partition's wake channel, whose name is the partition's
-- prefix and `wake` (keys.rs), built from its `due` key. `WAKE` is PUBLISH on one server and
-- SPUBLISH on a cluster (scripts.rs), where a shard channel stays on the master of its slot
-- instead of crossing the cluster bus to every node. `pcall`: a user whose ACL allows no
-- channels still writes; the dispatchers then find the work by their poll.
local function wake_dispatchers(due_key)
  redis.pcall(WAKE, string.sub(due_key, 1, -4) .. 'wake', '')
end
