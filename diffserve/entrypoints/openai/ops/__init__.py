"""Operations routes: ``/health`` (`health`), ``/metrics`` (`metrics`, Prometheus) and the
engine controls ``POST /sleep`` / ``POST /wake_up`` (`sleep`)."""
