-- wrk script: each connection waits between its requests so that the whole run sends about
-- BENCH_RATE requests per second over BENCH_CONNS connections (wrk -c must match); with
-- BENCH_KEYS > 0 every request carries `Authorization: Bearer tok-<n>`, n uniform in
-- 1..BENCH_KEYS, as bench/lua/tokens.lua does. wrk's delay() is in whole milliseconds.
local rate = tonumber(os.getenv("BENCH_RATE") or "1000")
local conns = tonumber(os.getenv("BENCH_CONNS") or "32")
local keys = tonumber(os.getenv("BENCH_KEYS") or "0")
local prefix = "Bearer tok-"

function init(args)
  local addr = tonumber(tostring({}):match("0x(%x+)") or "0", 16)
  math.randomseed(os.time() + addr % 1000003)
end

function delay()
  return math.floor(1000 * conns / rate)
end

function request()
  if keys > 0 then
    wrk.headers["Authorization"] = prefix .. math.random(1, keys)
  end
  return wrk.format()
end
