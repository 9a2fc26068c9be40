-- wrk script: every request carries `Authorization: Bearer tok-<n>`, n uniform in 1..KEYS
-- (default 10000), so a `header:authorization` limit sees KEYS distinct buckets.
-- KEYS can be changed with the environment variable BENCH_KEYS.
local keys = tonumber(os.getenv("BENCH_KEYS") or "10000")
local prefix = "Bearer tok-"

function init(args)
  -- wrk gives each thread its own Lua state; seed each one differently
  local addr = tonumber(tostring({}):match("0x(%x+)") or "0", 16)
  math.randomseed(os.time() + addr % 1000003)
end

function request()
  wrk.headers["Authorization"] = prefix .. math.random(1, keys)
  return wrk.format()
end
