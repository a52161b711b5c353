"""sluice's one settings schema. See settings.py for every knob."""

from config.settings import EngineSettings, ServerSettings, SettingsError

__all__ = ["EngineSettings", "ServerSettings", "SettingsError"]
