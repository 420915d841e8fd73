"""The torch driver of the engine: dispatch mode, wrapper subclass, op facts, replays."""
