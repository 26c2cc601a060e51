"""Process-wide basics: settings (REIN_* variables), logging, input checks, CPU pinning."""
