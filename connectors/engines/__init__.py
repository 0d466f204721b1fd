"""Model engines behind `operators.engine.Engine`: vLLM in process, an OpenAI-compatible HTTP
server, and a fake for fast tests; `factory.open_engine` opens the one an `EngineSpec` names."""
